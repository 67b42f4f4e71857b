"""The service: an API process (HTTP, ingestion and query logic) and model processes behind one seam.

Folders, each importing only the ones below it (docs/DESIGN.md, "Layout: folders and the seam"):
  cli.py, state.py  the composition root: settings -> the parts below, their startup and shutdown
  api/              HTTP only: routes, request and response models, auth, SSE, error mapping
  rag/              ingestion and queries over the corpus (store + indexes), returning plain data
  dispatch/         the seam: one local worker, a local pool, or a fleet over Redis, behind one interface
  worker/           the model process: engine loop, scheduler, per-job state, chunk KV, fleet worker
  wire/             the messages, their codec and the fleet's Redis keys, shared by both sides
"""
