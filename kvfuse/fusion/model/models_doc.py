"""The supported-models page, docs/models.md, rendered from the code that decides it.

The families and what each one's layers carry come from kvfuse/fusion/model/families.py; the rope types
served and the length limits from rope.py; what each fusion method does on a model with sliding-window
layers from the methods' own declarations (`window_refusal`, `window_note`) and eviction's; the load
check's steps from check.py. Regenerate it after changing any of them:

    kvfuse models docs -o docs/models.md

tests/fusion/test_models_doc.py fails while the committed page differs from what this renders.
"""

from __future__ import annotations

from pathlib import Path

from kvfuse.fusion.model import check, families, rope

INTRO = """\
kvfuse runs a model's decoder itself, layer by layer, so that a fused prefill can recompute any rows of
a cache assembled from stored chunks (docs/DESIGN.md, Fusion). It does so with the model's own
transformers modules (embedding, norms, projections, MLP, rotary embedding) wired as each family's
modeling code wires them; only attention is written out. A model type is served when its family is in
the table below; anything its config asks for that the table does not compute is caught at start by the
load check, which compares the engine with transformers' own forward before the service reports ready."""

LAYOUTS = {"pre": "pre-norm", "sandwich": "pre- and post-norm (4 per layer)", "post": "post-norm (OLMo 2)"}
QK_NORMS = {None: "—", "head": "per head", "projection": "whole projection"}
WINDOWS = {"none": "none", "all": "every layer (`sliding_window`)", "layer_types": "per `layer_types`"}


def _families() -> list[str]:
    out = ["| model type | models | norms | q/k norm | sliding windows | soft-capping | attention at ingestion |",
           "|---|---|---|---|---|---|---|"]
    for f in families.FAMILIES.values():
        caps = [c for c, on in (("attention", f.attn_softcap), ("final logits", f.final_softcap)) if on]
        out.append(f"| `{f.model_type}` | {f.models} | {LAYOUTS[f.layout]} | {QK_NORMS[f.qk_norm]} | "
                   f"{WINDOWS[f.windows]} | {', '.join(caps) or '—'} | {f.attn_implementation} |")
    return out


def _features() -> list[str]:
    return [f"- `{f.model_type}`: {'; '.join(f.notes)}." for f in families.FAMILIES.values() if f.notes]


def _positions() -> list[str]:
    composable = ", ".join(f"`{t}`" for t in sorted(rope.COMPOSABLE_ROPE_TYPES))
    return [
        f"Rope types served at any length: {composable} (a fixed rotation per position: a stored chunk's keys "
        "are moved to their place by rotating them, with cos/sin from the model's own rotary module).",
        "",
        "Rope types that depend on the sequence length, served up to the length where stored caches stay valid:",
        "",
        "- `longrope` (Phi-3.5/4-mini): the short factors apply while the sequence is within "
        "`original_max_position_embeddings`, and every position switches to the long factors past it, so the "
        "engine's context stops there; a longer prompt is refused with a message that says so.",
        "- `dynamic` (NTK): the plain rotation up to `max_position_embeddings`, the model's own limit, which the "
        "engine never passes.",
        "",
        "Any other rope type is refused at load. A model with one rotary embedding per layer type (Gemma 3: "
        "local layers base 10k, global layers 1M) recovers each layer's keys with its own.",
    ]


def _windows() -> list[str]:
    from kvfuse.fusion import eviction
    from kvfuse.fusion.methods.base import registry

    out = ["A sliding-window layer's row at position p attends to keys > p - window, as transformers' mask; a "
           "global layer to every key before it. Every prefill path computes that (the full prefill, the fused "
           "methods' recompute, the question-only probe, the blocked CPU kernel, FlexAttention, the dense "
           "reference), so the context is bounded by the model's positions, not by its window. With such "
           "layers:", "", "| method | on a model with sliding-window layers |", "|---|---|"]
    for name, cls in sorted(registry().items()):
        if cls.window_refusal:
            text = f"refused: {cls.window_refusal}"
        elif cls.window_note:
            text = cls.window_note
        else:
            text = "served: every layer attends within its own window (probe and check layer included)"
        out.append(f"| `{name}` | {text} |")
    out.append(f"| eviction (`fusion.evict_capacity`) | refused: {eviction.WINDOW_REFUSAL} |")
    return out


def _refused() -> list[str]:
    out = [f"- `{t}`: {why}." for t, why in sorted(families.REFUSED.items())]
    out.append("- any other model type: not in the table above; the load names the supported ones.")
    out.append("- a config setting the engine does not compute (for example `use_bidirectional_attention` on "
               "Gemma 3, as EmbeddingGemma sets it): refused at start by the load check, which names the "
               "first layer where the engine and transformers part.")
    return out


def _check() -> list[str]:
    tol = (f"a tolerance from the dtype's rounding: {check.TOLERANCE_FACTOR:g} (u + sqrt(K) u32) sqrt(L (1 + s)) for "
           "unit roundoff u (bfloat16 2^-8, float16 2^-11, float32 2^-24), inner products of up to K terms "
           "accumulated in float32, L layers and decode step s (kvfuse/fusion/model/check.py, `tolerance`)")
    return [
        f"`model.check_on_load` (on by default) runs it in the worker before `/ready`, and remembers a pass for "
        f"that model on that code, device and torch (`<models_dir>/checks/`, else `<data_dir>/model-checks/`), so "
        f"a restart skips it (kvfuse/fusion/model/check_cache.py); a failure is checked again at every start. "
        f"`kvfuse models check PATH` "
        f"runs it from the command line, prints a verdict per check and exits 0 (passed) or 2. On a canned prompt "
        f"of {check.CHECK_TOKENS} tokens, or the config's `sliding_window` plus {check.WINDOW_MARGIN} where that is "
        "longer (read from the config, not the family table, so every window is crossed):",
        "",
        "- `forward`: the embedding, every layer's hidden state and K/V, and the logits of the engine's full "
        "prefill against transformers' forward (`output_hidden_states`);",
        f"- `decode`: {check.DECODE_STEPS - 1} decode steps through the engine's decode step against "
        "transformers' forward over the same tokens;",
        "- `recovery`: a chunk cached after its context, its keys rotated back to positions 0..n-1 and moved "
        "into place again, reproduces the full prefill's cache and logits;",
        f"- `fused:<method>` for {', '.join(f'`{m}`' for m in check.FUSED_METHODS)}: recompute ratio 1.0 "
        "equals the full prefill (K/V of every layer, logits); a method that refuses the model is listed as "
        "refused.",
        "",
        f"Errors are the RMS of the difference over the reference's RMS, against {tol}. A failure refuses to "
        "serve, naming the first layer where the two part; the time the check took is in the worker's log.",
        "",
        "Before any comparison, `range`: where transformers' own forward leaves the dtype's range (inf, then "
        "NaN), the check fails naming the first hidden state that does, rather than an error of NaN at some "
        "layer. Gemma 3's residual stream grows past float16's largest value (65504), so it is refused in "
        "float16 and served in bfloat16 or float32. The errors measured on SmolLM2 and Gemma 3 270M in each "
        "dtype, with their tolerances: [results/model-check](results/model-check/README.md).",
    ]


def _preparing() -> list[str]:
    from kvfuse import model_sources
    from kvfuse.fusion import prompt_style

    arches = ", ".join(f"`{a}` ({t})" for a, t in sorted(model_sources.GGUF_ARCHITECTURES.items()))
    return [
        "`kvfuse models prepare SOURCE` writes a checkpoint as a served model folder under the models dir, runs "
        "the load check on it and prints the `model.llm` that serves it (kvfuse/model_sources.py). SOURCE is a "
        "GGUF file (every quantized type dequantized; written in float32 when that takes at most half the "
        "machine's memory, else bfloat16; `--write-dtype` chooses), a transformers folder (copied; a multimodal "
        "Gemma 3, `gemma3`, has its language model extracted as `gemma3_text`), or an installed model package "
        "by its distribution name (its GGUF, its folder, or the GGUF its `assemble()` writes). GGUF "
        f"architectures converted: {arches}; any other is refused from the file's header. The folder is "
        "named for the model (GGUF `general.name`, the config's hub id or the model card's title; `--name`), "
        "the id `/v1/models` lists.",
        "",
        "How a model is prompted is chosen at load from its tokenizer (kvfuse/fusion/prompt_style.py) and named "
        f"in `/ready`: `{prompt_style.CHAT}` (its chat template, with a system turn), `{prompt_style.SYSTEM_IN_USER}` "
        "(a template that refuses or drops a system role, as Gemma 2's: the system text opens the user turn) "
        f"or `{prompt_style.BASE}` (no chat template: the system text, the documents, "
        f"\"Question: ...\", then \"{prompt_style.BASE_ANSWER.strip()}\" on a line of its own; an answer stops at "
        f"{' or '.join(repr(s) for s in prompt_style.BASE_STOPS)}).",
    ]


def render() -> str:
    """The whole page, ending with one newline."""
    parts = ["# Supported models", "",
             "<!-- Generated by `kvfuse models docs` from kvfuse/fusion/model/ and the fusion methods; "
             "do not edit by hand. -->", "", INTRO, "",
             "## Families", "", *_families(), "",
             "What else each family's modules carry (computed by the HF modules the engine calls): fused "
             "projections, biases, mixture-of-experts MLPs, scaled and tied embeddings need nothing of the "
             "engine.", "", *_features(), "",
             "## Preparing a checkpoint", "", *_preparing(), "",
             "## Positions", "", *_positions(), "",
             "## Sliding windows", "", *_windows(), "",
             "## Refused", "", *_refused(), "",
             "## The load check", "", *_check(), ""]
    return "\n".join(parts)


def write(output: str | None) -> str:
    text = render()
    if output:
        Path(output).write_text(text, encoding="utf-8")
    return text
