"""Check that a converted default model has exactly the weights of a manifest made where it was first
prepared (tensor name -> dtype, shape, sha256 of its bytes); exits 1 on any difference.

    python studies/gpu/check_model.py MODEL_DIR MANIFEST.json

The default model is converted from its GGUF on each machine (kvfuse/model_files.py); on another machine
the conversion runs under other library versions, and fidelity numbers are only comparable with those
made here when the weights are the same bits.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open


def main(model_dir: str, manifest: str) -> int:
    want = json.loads(Path(manifest).read_text())
    got = {}
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k).contiguous()
                got[k] = [str(t.dtype), list(t.shape), hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
    bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    print(f"{len(got)} tensors, {len(bad)} differ from the manifest" + (f": {bad[:5]}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
