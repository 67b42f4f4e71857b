"""Ingestion and queries over the corpus (store, vector and keyword indexes), with explicit collaborators
and plain data out; no HTTP here."""
