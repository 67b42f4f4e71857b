"""Prometheus metrics (vLLM-style names), one registry per app so several apps can live in a process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("kvfuse_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("kvfuse_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.queue_time = Histogram("kvfuse_request_queue_time_seconds", "Time a query waited for the worker",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvfuse_e2e_request_latency_seconds", "Query latency, arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.retrieval = Histogram("kvfuse_retrieval_seconds", "Embedding plus vector search",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_load = Histogram("kvfuse_kv_load_seconds", "Loading chunk KV from the store",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.hit_tokens = Counter("kvfuse_kv_cache_hit_tokens", "Prompt tokens whose KV was reused", registry=r)
        self.query_tokens = Counter("kvfuse_kv_cache_query_tokens", "Prompt tokens of all queries", registry=r)
        self.running = Gauge("kvfuse_num_requests_running", "Queries being generated", registry=r)
        self.waiting = Gauge("kvfuse_num_requests_waiting", "Queries waiting for the worker", registry=r)
        self.documents = Gauge("kvfuse_documents", "Documents in the store", registry=r)
        self.kv_chunks = Gauge("kvfuse_kv_chunks", "Chunk KV blobs in the store", registry=r)
        self.kv_bytes = Gauge("kvfuse_kv_bytes", "Bytes of chunk KV in the store", registry=r)
        self.requests = Counter("kvfuse_requests", "Finished queries by outcome", ["outcome"], registry=r)
        self.precomputed_chunks = Counter("kvfuse_precomputed_chunks", "Chunk KV caches computed by the worker",
                                          registry=r)
        self.rebuilt_chunks = Counter("kvfuse_rebuilt_chunks", "Chunk KV rebuilt at query time (miss or corrupt)",
                                      registry=r)
        self.worker_restarts = Counter("kvfuse_worker_restarts", "Times the worker process was restarted",
                                       registry=r)
