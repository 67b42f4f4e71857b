"""The model: the decoder run layer by layer over a fused cache (transformer.py) as each supported family
wires its layers (families.py), the attention kernels that serve each row set (attention.py,
attention_cpu.py, attention_flex.py, attention_math.py), RoPE and position recovery (rope.py), loading and
identifying a checkpoint (loading.py), the load check against transformers (check.py) and the
supported-models page rendered from all of it (models_doc.py)."""
