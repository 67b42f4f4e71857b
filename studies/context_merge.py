"""Join the shards of a context_modes.py run (STUDY_SHARD) into one run, as if one process had made it.

    python studies/context_merge.py PREFIX

Reads PREFIX.s<I>-<mode>.json for every shard I and mode, and writes PREFIX-<mode>.json: the outcomes
of all shards, the rows aggregated again over all of them (kvfuse.bench.fidelity.aggregate), the ingest
counters summed, and the shards' command with STUDY_SHARD taken out. An example counts only when its
vanilla outcome is there (a shard stopped mid-example has saved none of that example).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from kvfuse.bench import report
from kvfuse.bench.fidelity import Outcome, aggregate, outcome_dicts


def merge(prefix: str) -> list[Path]:
    base = Path(prefix)
    by_mode: dict[str, list[Path]] = {}
    for path in sorted(base.parent.glob(base.name + ".s*-*.json")):
        m = re.fullmatch(re.escape(base.name) + r"\.s(\d+)-(.+)\.json", path.name)
        if m:
            by_mode.setdefault(m.group(2), []).append(path)
    written = []
    for mode, paths in by_mode.items():
        payloads = [json.loads(p.read_text(encoding="utf-8")) for p in paths]
        outcomes = [Outcome(**o) for pl in payloads for o in pl["outcomes"]]
        ingest = dict(payloads[0]["ingest"])
        for key in ("chunk_tokens", "context_tokens", "precompute_s", "embed_s"):
            ingest[key] = sum(pl["ingest"][key] for pl in payloads)
        secs = ingest["precompute_s"] + ingest["embed_s"]
        # K processes share one accelerator: this is chunk tokens per process-second, not wall time.
        ingest["chunk_tokens_per_s"] = ingest["chunk_tokens"] / secs if secs else None
        command = re.sub(r"STUDY_SHARD=\S+ ", "", payloads[0]["command"])
        out = {**payloads[0], "command": command, "shards": len(paths), "rows": report.sort_fidelity(aggregate(outcomes)),
               "outcomes": outcome_dicts(outcomes), "ingest": ingest}
        target = Path(f"{prefix}-{mode}.json")
        target.write_text(json.dumps(out, indent=1))
        written.append(target)
        n = len({(o.task, o.example_id) for o in outcomes if o.method == "vanilla"})
        print(f"{target}: {len(paths)} shards, {n} examples, {len(outcomes)} outcomes")
    return written


if __name__ == "__main__":
    sys.exit(0 if merge(sys.argv[1]) else 1)
