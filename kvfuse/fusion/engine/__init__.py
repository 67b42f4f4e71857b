"""The engine: what runs requests once a prompt is fused -- per-request decoding state (generation.py,
detokenize.py, sampling.py, logprobs.py)."""
