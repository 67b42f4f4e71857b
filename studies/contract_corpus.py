"""The multi-document benchmark's examples (kvfuse/bench/multidoc.py) as a corpus to ingest and query files
for `kvfuse calibrate`: each example's documents as text files (ids `<example>-d<k>`), and JSON lines of
{"query", "document_ids"} with the documents in retrieval order (the embedder's, as the service fuses its
hits), split into a calibration set and a held-out set. docs/results/contract/README.md runs it.

    python studies/contract_corpus.py OUT --n 40 --held-out 30 --docs 4 --doc-tokens 200
    kvfuse ingest --local OUT/documents
    kvfuse calibrate --target 0.8 --queries OUT/calibration.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvfuse.bench import multidoc, tasks
from kvfuse.bench.engine_backend import load_embedder
from kvfuse.config import get_settings

TASKS = ("needle", "multikey")  # one asked value each


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--n", type=int, default=40, help="calibration queries")
    ap.add_argument("--held-out", type=int, default=30, help="held-out queries (other seeds)")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=200)
    ap.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from kvfuse.model_files import resolve_llm

    s = get_settings()
    tok = AutoTokenizer.from_pretrained(resolve_llm(s.model.llm, s.models_dir))
    corpus = multidoc.Corpus(tok, args.data_dir, args.doc_tokens)
    embed = load_embedder(s).embed
    docs_dir = args.out / "documents"
    docs_dir.mkdir(parents=True, exist_ok=True)
    for name, seed, count in (("calibration", 0, args.n), ("held-out", 1, args.held_out)):
        rows = []
        per_task = (count + len(TASKS) - 1) // len(TASKS)
        cfg = tasks.TaskConfig(n=per_task, docs=args.docs, doc_tokens=args.doc_tokens, seed=seed)
        for task in TASKS:
            for ex in multidoc.build_examples(task, corpus, cfg, "retrieval", embed):
                ids = [f"{ex.id}-d{k}" for k in range(len(ex.chunks))]
                for doc_id, text in zip(ids, ex.chunks, strict=True):
                    (docs_dir / f"{doc_id}.txt").write_text(text)
                rows.append({"query": ex.question, "document_ids": ids, "answers": ex.answers})
        rows = rows[:count]
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{name}: {len(rows)} queries")


if __name__ == "__main__":
    main()
