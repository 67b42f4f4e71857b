"""`kvfuse train kvlink`: train kvlink's link-token embeddings for the configured model.

Nothing heavy is imported until the subcommand runs."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def _pair(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected LO,HI: {text!r}") from err
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 0 < LO <= HI: {text!r}")
    return lo, hi


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from err
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError("link counts must be positive")
    return counts


def _plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    keys = sorted({k for r in history for k in r if k.startswith(("loss_k", "val_k"))})
    for key in keys:
        pts = [(r["step"], r[key]) for r in history if key in r]
        xs, ys = zip(*pts, strict=True)
        if key.startswith("loss_k"):  # noisy per-example losses: a moving average of 25 steps
            w = 25
            ys = [sum(ys[max(0, i - w + 1) : i + 1]) / len(ys[max(0, i - w + 1) : i + 1]) for i in range(len(ys))]
            ax.plot(xs, ys, label=f"train K={key[6:]} (mean of {w})", alpha=0.7)
        else:
            ax.plot(xs, ys, "o-", label=f"held-out K={key[5:]}" + (" (pie)" if key == "val_k0" else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("answer cross-entropy (nats/token)")
    ax.set_title("kvlink link-embedding training")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _train_kvlink(args: argparse.Namespace) -> int:
    from kvfuse.bench.data import resolve_data_dir
    from kvfuse.config import get_settings
    from kvfuse.fusion import FusionEngine
    from kvfuse.fusion.methods.kvlink import artifacts_dir
    from kvfuse.train.kvlink import TrainConfig, Trainer

    settings = get_settings()
    data_dir = resolve_data_dir(args.data_dir)
    cfg = TrainConfig(steps=args.steps, minutes=args.minutes, link_counts=args.link_tokens, max_docs=args.max_docs, docs=args.docs,
                      doc_tokens=args.doc_tokens, lr=args.lr, seed=args.seed, val_examples=args.val_examples,
                      val_every=args.val_every, save_every=args.save_every,
                      system_prompt=settings.model.system_prompt)
    engine = FusionEngine.from_settings(settings)
    artifact_dir = Path(args.artifact_dir) if args.artifact_dir else artifacts_dir(settings)
    run_dir = Path(args.run_dir) if args.run_dir else settings.data_dir / "train" / "kvlink" / engine.fingerprint[:16]
    print(f"model fingerprint {engine.fingerprint[:16]}; run dir {run_dir}; artifact dir {artifact_dir}",
          file=sys.stderr)
    print(f"command: kvfuse {' '.join(shlex.quote(a) for a in sys.argv[1:])}", file=sys.stderr)
    print(f"config: {json.dumps(cfg.to_json())}", file=sys.stderr)
    trainer = Trainer(engine, cfg, data_dir, run_dir, artifact_dir, log=lambda s: print(s, file=sys.stderr, flush=True))
    if not args.restart:
        trainer.resume()
    trainer.run()
    path = trainer.save()
    _plot(trainer.history, run_dir / "loss.png")
    summary = {"steps": trainer.step, "train_seconds": round(trainer.elapsed, 1), "artifact": str(path),
               "artifact_bytes": path.stat().st_size, "first": trainer.history[0], "last": trainer.history[-1]}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train what a fusion method learns for the configured model")
    tsub = train.add_subparsers(dest="train_command", metavar="METHOD", required=True)
    p = tsub.add_parser("kvlink", help="train kvlink's link-token embeddings (resumes from the run dir)")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps (one example, every K, per step)")
    p.add_argument("--minutes", type=float, default=0.0,
                   help="wall-clock budget of the training steps; ends early when spent (default: none)")
    p.add_argument("--link-tokens", type=_counts, default=(1, 5), help="link counts K to train (default 1,5)")
    p.add_argument("--max-docs", type=int, default=8, help="chunk indices with links of their own (default 8)")
    p.add_argument("--docs", type=_pair, default=(2, 8), help="documents per example, LO,HI (default 2,8)")
    p.add_argument("--doc-tokens", type=_pair, default=(40, 110),
                   help="essay tokens per document before its facts, LO,HI (default 40,110)")
    p.add_argument("--lr", type=float, default=5e-3, help="Adam peak learning rate (default 5e-3)")
    p.add_argument("--seed", type=int, default=1, help="data stream seed (default 1)")
    p.add_argument("--val-examples", type=int, default=16, help="held-out examples (default 16)")
    p.add_argument("--val-every", type=int, default=100, help="held-out loss every N steps (default 100)")
    p.add_argument("--save-every", type=int, default=25, help="checkpoint every N steps (default 25)")
    p.add_argument("--run-dir", help="checkpoints, log, plot (default <data_dir>/train/kvlink/<fingerprint>)")
    p.add_argument("--artifact-dir", help="where the artifact goes (default fusion.kvlink_dir, where the "
                                          "server loads it)")
    p.add_argument("--data-dir", help="essays (default: the setting bench.data_dir)")
    p.add_argument("--restart", action="store_true", help="ignore an existing checkpoint in the run dir")
    p.set_defaults(func=_train_kvlink)
