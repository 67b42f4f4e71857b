"""The model process: the engine loop (core.py), its scheduler, per-job state, chunk KV, and the fleet
worker that serves the same loop over Redis."""
