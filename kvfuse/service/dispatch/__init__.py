"""The seam between the API process and the model: a local worker process, a local pool or a fleet of
`kvfuse worker`s over Redis, all offering the interface of dispatch/base.py."""
