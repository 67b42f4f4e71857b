"""HTTP only: routes, request and response models, auth, SSE and error mapping; logic lives in rag/."""
