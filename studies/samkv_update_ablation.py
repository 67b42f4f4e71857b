"""samkv update rule on the needle task: Eq. 4 fusion vs overwrite vs every block kept (fusion), same
examples as docs/results/samkv/fidelity.json (needle, --docs 4 --doc-tokens 512, seed 0). Output:
docs/results/samkv/update_ablation.txt."""
from kvfuse.bench import tasks
from kvfuse.bench.data import resolve_data_dir
from kvfuse.bench.engine_backend import EngineBackend
from kvfuse.config import load_settings

s = load_settings()
b = EngineBackend(s, max_tokens=None)
hay = tasks.Haystack(b.tokenizer, resolve_data_dir())
variants = {"fusion": {}, "overwrite": {"samkv_update": "overwrite"},
            "all_blocks": {"samkv_min_p": 1.0, "samkv_cross_cut": False}}
for i in range(4):
    ex = tasks.synthetic("needle", hay, tasks.TaskConfig(n=4, docs=4, doc_tokens=512, seed=0), i)
    prep = b.prepare(ex)
    b.ingest_artifacts("samkv", prep[1])
    for name, kw in variants.items():
        opts = b.options("samkv", 0.15)
        for k, v in kw.items():
            setattr(opts, k, v)
        ans = b.greedy(*prep, opts, ex.max_tokens)
        text, st = ans.text, ans.stats
        print(i, name, repr(text.strip()[:30]), ex.answers, "loaded", round(st["kv_loaded_bytes"] / st["kv_total_bytes"], 3), flush=True)
