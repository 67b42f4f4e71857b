"""`kvfuse train kvlink`: train the link-token embeddings of `kvlink` for the configured model.

What is trained: for each link count K (the paper's 1 and 5), a table [max_docs, K, hidden] of input
embeddings, row n for the links after the n-th chunk. The model's weights are frozen (the served model
is shared by every method and by the stored caches; docs/methods/kvlink.md discusses the paper's full
fine-tune).

The forward is the paper's attention pattern, computed the way the engine serves it, so training and
serving run the same computation: each document is encoded alone (`FusionEngine.precompute`: it
attends only within itself), its keys rotated to its global position with K link slots after it, and
the link rows, the question and the answer run through every layer, each row attending causally by
global position (links to everything before them, question and answer to everything). The documents'
K/V do not depend on the link embeddings, so they are computed without gradients, once per example and
shared by every K. The loss is the answer's cross-entropy (answer tokens and the turn end), as in the
paper (§2.3: "trained to generate the ground-truth answer").

Progress is printed per step; every `save_every` steps a checkpoint (embeddings, optimizer, step, log)
is written to the run directory and the artifact refreshed, and a rerun with the same directory
resumes from it (the data stream is a pure function of the step, so a resumed run sees the same data).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvfuse.fusion.engine.fused_cache import FusedCache
from kvfuse.fusion.errors import UnsupportedModelError
from kvfuse.fusion.methods.kvlink import link_layout
from kvfuse.fusion.methods.kvlink_artifact import LinkArtifact, artifact_path
from kvfuse.fusion.types import ChunkKV
from kvfuse.train.kvlink_data import LinkExample, Passages, make_example

CHECKPOINT = "checkpoint.pt"
LOG = "train_log.jsonl"


@dataclass
class TrainConfig:
    steps: int = 600
    minutes: float = 0.0  # wall-clock budget of the training steps (0: none); the run ends at whichever comes first
    link_counts: tuple[int, ...] = (1, 5)
    max_docs: int = 8  # link indices in the table (chunks past it reuse the last)
    docs: tuple[int, int] = (2, 8)  # documents per example
    doc_tokens: tuple[int, int] = (40, 110)  # passage length per document (before the facts)
    lr: float = 5e-3
    warmup: int = 20
    seed: int = 1
    val_examples: int = 16
    val_every: int = 100
    save_every: int = 25
    system_prompt: str = "You are a helpful assistant. Answer the question using the documents. Answer briefly."
    init_token: str = "\n"  # link embeddings start as this token's embedding

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Encoded:
    """One example as token ids, with its documents' caches (computed once, shared by every K)."""

    prefix: ChunkKV
    chunks: list[ChunkKV]
    question_ids: list[int]
    answer_ids: list[int]


def encode(engine, ex: LinkExample, system_prompt: str, prefix: ChunkKV | None = None) -> Encoded:
    prefix_ids, question_ids = engine.prompt_parts(ex.question, system_prompt)
    end = sorted(engine.stop_token_ids - {engine.tokenizer.eos_token_id}) or sorted(engine.stop_token_ids)
    answer_ids = engine.tokenize(ex.answer) + end[:1]
    with torch.no_grad():
        kvs = engine.precompute(([] if prefix is not None else [prefix_ids]) + [engine.tokenize(d) for d in ex.docs])
    kvs = [ChunkKV(c.token_ids, c.k.clone(), c.v.clone()) for c in kvs]  # out of inference mode
    if prefix is None:
        prefix, kvs = kvs[0], kvs[1:]
    return Encoded(prefix, kvs, question_ids, answer_ids)


def link_rows_forward(engine, enc: Encoded, links: torch.Tensor, k: int) -> torch.Tensor:
    """Logits [A, vocab] predicting the answer tokens, for link embeddings `links` [N, K, hidden]
    (differentiable in them). K = 0: no links (`pie`)."""
    tf, device = engine.tf, engine.device
    chunk_lens = [len(c) for c in enc.chunks]
    p = len(enc.prefix)
    slots = [p + i for i in link_layout(chunk_lens, k)]
    context = sum(chunk_lens) + k * len(chunk_lens)
    tail = enc.question_ids + enc.answer_ids
    total = p + context + len(tail)
    positions = torch.tensor(slots + list(range(p + context, total)), device=device)
    with torch.no_grad():  # the fixed K/V: prefix and documents, keys at their global positions
        base = FusedCache(engine.num_layers, engine.num_kv_heads, engine.head_dim, total, engine.dtype, device)
        base.k.zero_()
        base.v.zero_()
        base.place(0, enc.prefix.k, enc.prefix.v)
        start = p
        for c in enc.chunks:
            base.place(start, c.k, c.v)
            tf.shift_keys_(base.k[:, :, start : start + len(c)], start)
            start += len(c) + k
    h = tf.embed(torch.tensor(tail, device=device))
    if k:
        h = torch.cat([links[: len(chunk_lens), :k].reshape(1, -1, h.shape[-1]).to(h.dtype), h], dim=1)
    rows = tf.rows(positions)
    mask = positions[:, None] >= torch.arange(total, device=device)[None, :]  # causal by global position
    for layer in range(tf.num_layers):
        q, kk, vv = tf.project(layer, h, *rows.cos_sin(layer))
        keys = base.k[layer].index_copy(1, positions, kk[0].to(base.k.dtype)).unsqueeze(0)
        values = base.v[layer].index_copy(1, positions, vv[0].to(base.v.dtype)).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=tf.scale, enable_gqa=True)
        h = tf.finish(layer, h, out)
    first = len(slots) + len(enc.question_ids) - 1  # the row predicting the first answer token
    return tf.logits(h[0, first : first + len(enc.answer_ids)])


def answer_loss(engine, enc: Encoded, links: torch.Tensor, k: int) -> torch.Tensor:
    logits = link_rows_forward(engine, enc, links, k)
    return F.cross_entropy(logits, torch.tensor(enc.answer_ids, device=logits.device))


def init_tables(engine, cfg: TrainConfig) -> dict[int, torch.nn.Parameter]:
    token = engine.tokenize(cfg.init_token)[:1] or [0]
    row = engine.tf.embed_tokens.weight[token[0]].detach().float()
    return {k: torch.nn.Parameter(row.expand(cfg.max_docs, k, -1).clone()) for k in cfg.link_counts}


def _lr(cfg: TrainConfig, step: int, elapsed_s: float = 0.0) -> float:
    """Linear warmup, then cosine decay to a tenth over the run's progress: the share of steps done or of
    the time budget spent, whichever is larger (so a run cut by its budget still ends decayed)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    if cfg.minutes > 0:
        t = max(t, elapsed_s / (60 * cfg.minutes))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


class Trainer:
    """One training run in `run_dir` (resumable), writing the artifact to `artifact_dir`."""

    def __init__(self, engine, cfg: TrainConfig, data_dir: Path, run_dir: Path, artifact_dir: Path,
                 log: Callable[[str], None] = print) -> None:
        if any(w is not None for w in engine.tf.windows) or engine.tf.softcap is not None:
            # link_rows_forward attends with a plain causal mask: no sliding window, no soft-capping
            raise UnsupportedModelError(f"kvfuse train kvlink does not compute the sliding windows or soft-capped "
                                        f"attention of this {engine.family.model_type} model")
        self.engine, self.cfg, self.run_dir, self.artifact_dir, self.log = engine, cfg, Path(run_dir), \
            Path(artifact_dir), log
        for p in engine.model.parameters():
            p.requires_grad_(False)
        self.passages = Passages(engine.tokenizer, data_dir)
        self.tables = init_tables(engine, cfg)
        self.opt = torch.optim.Adam(list(self.tables.values()), lr=cfg.lr)
        self.step = 0
        self.history: list[dict] = []
        self.elapsed = 0.0
        self.placeholder = (engine.tokenize(cfg.init_token)[:1] or [0])[0]
        prefix_ids, _ = engine.prompt_parts("?", cfg.system_prompt)
        with torch.no_grad():
            kv = engine.precompute([prefix_ids])[0]
        self.prefix = ChunkKV(kv.token_ids, kv.k.clone(), kv.v.clone())
        self.val = [self.example(-1 - i) for i in range(cfg.val_examples)]  # negative indices: held out

    def example(self, index: int) -> Encoded:
        c = self.cfg
        ex = make_example(self.passages, c.seed, index, c.docs, c.doc_tokens)
        return encode(self.engine, ex, c.system_prompt, self.prefix)

    # -- state ---------------------------------------------------------------------------------------
    def resume(self) -> bool:
        path = self.run_dir / CHECKPOINT
        if not path.is_file():
            return False
        state = torch.load(path, weights_only=False)
        if state["fingerprint"] != self.engine.fingerprint:
            raise ValueError(f"{path} belongs to another model (fingerprint {state['fingerprint'][:16]})")
        with torch.no_grad():
            for k, t in state["tables"].items():
                self.tables[int(k)].copy_(t)
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.history, self.elapsed = state["step"], state["history"], state["elapsed"]
        self.log(f"resumed from {path} at step {self.step}")
        return True

    def save(self) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        state = {"fingerprint": self.engine.fingerprint, "step": self.step, "history": self.history,
                 "elapsed": self.elapsed, "config": self.cfg.to_json(),
                 "tables": {k: t.detach().clone() for k, t in self.tables.items()},
                 "optimizer": self.opt.state_dict()}
        tmp = self.run_dir / (CHECKPOINT + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.run_dir / CHECKPOINT)
        (self.run_dir / LOG).write_text("".join(json.dumps(r) + "\n" for r in self.history))
        path = artifact_path(self.artifact_dir, self.engine.fingerprint)
        self.artifact().save(path)
        return path

    def artifact(self) -> LinkArtifact:
        meta = {"steps": str(self.step), "placeholder_id": str(self.placeholder),
                "train_config": json.dumps(self.cfg.to_json()), "train_seconds": f"{self.elapsed:.0f}"}
        return LinkArtifact(self.engine.fingerprint, {k: t.detach() for k, t in self.tables.items()}, meta)

    # -- loop ----------------------------------------------------------------------------------------------
    def val_loss(self) -> dict[str, float]:
        out = {}
        with torch.no_grad():
            for k in (0, *self.cfg.link_counts):
                table = self.tables[k] if k else None
                out[f"val_k{k}"] = sum(answer_loss(self.engine, e, table, k).item() for e in self.val) / len(self.val)
        return out

    def train_step(self) -> dict:
        enc = self.example(self.step)
        lr = _lr(self.cfg, self.step, self.elapsed)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad()
        row = {"step": self.step + 1, "lr": lr}
        for k in self.cfg.link_counts:
            loss = answer_loss(self.engine, enc, self.tables[k], k)
            loss.backward()
            row[f"loss_k{k}"] = loss.item()
        self.opt.step()
        return row

    def out_of_time(self, pending_s: float = 0.0) -> bool:
        return self.cfg.minutes > 0 and self.elapsed + pending_s >= 60 * self.cfg.minutes

    def run(self) -> LinkArtifact:
        if not self.history:
            self.history.append({"step": 0, **self.val_loss(), "elapsed_s": 0.0})
            self.log(json.dumps(self.history[-1]))
        while self.step < self.cfg.steps and not self.out_of_time():
            t = time.perf_counter()
            row = self.train_step()
            self.step += 1
            last = self.step == self.cfg.steps or self.out_of_time(time.perf_counter() - t)
            if self.step % self.cfg.val_every == 0 or last:
                row.update(self.val_loss())
            self.elapsed += time.perf_counter() - t
            row["elapsed_s"] = round(self.elapsed, 1)
            self.history.append(row)
            self.log(f"step {self.step}/{self.cfg.steps} " + " ".join(
                f"{k}={v:.4g}" for k, v in row.items() if k not in ("step",)))
            if self.step % self.cfg.save_every == 0 or last:
                self.save()
        self.save()
        return self.artifact()

