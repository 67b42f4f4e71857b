"""The model: the decoder run layer by layer over a fused cache (transformer.py), the attention kernels
that serve each row set (attention.py, attention_cpu.py, attention_flex.py), RoPE and position recovery
(rope.py), and loading and identifying a checkpoint (loading.py)."""
