"""Study: which grammar library masks a token fastest on this CPU, for structured answers (issue: response_format).

For each candidate (llguidance, xgrammar, outlines-core) over the serving tokenizer (SmolLM2's, vocab 49152):
compile a JSON schema (and plain JSON), then walk the tokens of a valid answer one by one, timing per token
what the decode step would add: fill the row's allowed-token mask, apply it to a [vocab] logits row (-inf
where not allowed) and advance the matcher by the token. Reports compile time and per-token median / p90.

Usage: PYTHONPATH=<dirs holding the libraries> python studies/grammar_mask.py [JSON_OUT]
  (a library that does not import is reported as such and skipped)
"""

import json
import statistics
import sys
import time

import torch
from transformers import AutoTokenizer

MODEL = "data/models/SmolLM2-135M-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "year", "tags", "ok"],
    "additionalProperties": False,
}
ANSWER = '{"name": "The Old Man and the Sea", "year": 1952, "tags": ["novel", "fishing", "Cuba"], "ok": true}'
ROUNDS = 5


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """int32 bitmask [ceil(vocab/32)] -> logits with disallowed ids at -inf (the same for every library)."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(-1)[: logits.shape[0]].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def run_llguidance(tok, ids, schema):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    t_tok = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})

    def new():
        return llguidance.LLMatcher(lltok, grammar)

    mask = lt.allocate_token_bitmask(1, lltok.vocab_size)

    def step(m, logits, t):
        lt.fill_next_token_bitmask(m, mask, 0)
        out = apply_bitmask(logits, mask[0])
        assert out[t] > float("-inf"), "token refused"
        m.consume_token(t)
        return out

    return t_tok, new, step


def run_xgrammar(tok, ids, schema):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
    t_tok = time.perf_counter() - t0  # with the schema's compilation
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def new():
        return xgr.GrammarMatcher(compiled)

    def step(m, logits, t):
        m.fill_next_token_bitmask(mask, 0)
        out = apply_bitmask(logits, mask[0])
        assert out[t] > float("-inf"), "token refused"
        assert m.accept_token(t)
        return out

    return t_tok, new, step


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (how byte-level BPE vocabularies spell bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def run_outlines(tok, ids, schema):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    decode = {c: b for b, c in bytes_to_unicode().items()}
    table: dict[bytes, list[int]] = {}
    for piece, i in tok.get_vocab().items():
        if i == tok.eos_token_id or piece in tok.all_special_tokens:
            continue
        table.setdefault(bytes(decode[c] for c in piece), []).append(i)
    vocab = Vocabulary(tok.eos_token_id, table)
    index = Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern=r" ?"), vocab)
    t_tok = time.perf_counter() - t0  # outlines compiles the index per schema: this includes it
    mask = torch.zeros((len(tok) + 31) // 32, dtype=torch.int32)

    def new():
        return Guide(index)

    def step(m, logits, t):
        m.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        out = apply_bitmask(logits, mask)
        assert out[t] > float("-inf"), "token refused"
        m.advance(t)
        return out

    return t_tok, new, step


def measure(name, setup, tok, ids, schema):
    try:
        t_setup, new, step = setup(tok, ids, schema)
    except ImportError as err:
        return {"library": name, "error": f"not importable: {err}"}
    vocab = len(tok)
    logits = torch.randn(vocab)
    per_token = []
    compile_s = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        m = new()
        compile_s.append(time.perf_counter() - t0)
        for t in ids:
            t1 = time.perf_counter()
            step(m, logits, t)
            per_token.append(time.perf_counter() - t1)
    base = []
    for _ in range(ROUNDS * len(ids)):  # the mask application alone, for scale
        t1 = time.perf_counter()
        logits.masked_fill(logits > 10, float("-inf"))
        base.append(time.perf_counter() - t1)
    per_token.sort()
    return {"library": name, "setup_s": round(t_setup, 3), "matcher_s_median": round(statistics.median(compile_s), 5),
            "per_token_us_median": round(statistics.median(per_token) * 1e6, 1),
            "per_token_us_p90": round(per_token[int(0.9 * len(per_token))] * 1e6, 1),
            "masked_fill_us_median": round(statistics.median(base) * 1e6, 1), "tokens": len(ids) * ROUNDS}


def main() -> None:
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(MODEL)
    ids = tok.encode(ANSWER, add_special_tokens=False)
    results = []
    for name, setup in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar), ("outlines-core", run_outlines)):
        r = measure(name, setup, tok, ids, SCHEMA)
        print(json.dumps(r))
        results.append(r)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"vocab": len(tok), "answer_tokens": len(ids), "schema": SCHEMA, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
