"""Benchmarks: answer fidelity and speed of every fusion method, retrieval speed, their reports and plots.

`tasks` builds the examples (synthetic RULER-style tasks over the Paul Graham essays, and MuSiQue) from
the data `data` locates (setting `bench.data_dir`), `scoring` scores answers, `fidelity` and `speed` run
the engine, `retriever` times embedding and vector search, `report` writes result files, tables and the
results README block (docs/results/README.md), `plots` draws the figures (matplotlib, the optional extra
`kvfuse[bench]`).
Results and the studies behind the defaults are in docs/. Nothing here is imported by the service."""
