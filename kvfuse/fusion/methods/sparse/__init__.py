"""Sparse multi-context KV (the `samkv` method, SamKV): per-chunk artifacts computed at ingest, block
selection per query, and block sources that read only the selected blocks of a chunk's KV.

  blocks.py     how a chunk divides into 64-token blocks (initial, middle, local)
  artifacts.py  the ingest-time artifacts: block-mean keys, local queries, static attention analysis
  select.py     the query-time selection (Eqs. 1-3 and the cross-document cut), pure tensor code
  source.py     where a chunk's blocks are read from (memory or the store) and what was read

The method itself is kvfuse/fusion/methods/samkv.py; design and decisions: docs/methods/samkv.md.
"""
