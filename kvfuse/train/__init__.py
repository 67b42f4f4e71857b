"""Training what a fusion method learns for a model (`kvfuse train ...`): kvlink's link embeddings."""
