"""Benchmarks: answer fidelity and speed of every fusion method, their reports and plots.

`tasks` builds the examples (synthetic RULER-style tasks over the Paul Graham essays, and MuSiQue),
`scoring` scores answers, `fidelity` and `speed` run the engine, `report` writes tables, plots and the
README results block. Nothing here is imported by the service."""
