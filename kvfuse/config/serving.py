"""The sections of a running deployment: the HTTP server and its API keys, Redis access, and the fleet.

Declared as `sections.py` declares the rest (each field's description is the reference text of
docs/configuration.md); `kvfuse.config` puts every section together into `Settings`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from kvfuse.config.sections import Section, string_list


class KeyScope(Section):
    """What one API key may do (server.api_keys as a mapping, or server.api_keys_file)."""

    collections: list[str] | None = Field(None, min_length=1, description=(
        "the collections the key sees (absent = every collection)"))
    access: Literal["read", "write"] = Field("write", description=(
        "read: list, read, query and search; write: also ingest and delete"))


class ServerSettings(Section):
    """The HTTP server: address, API keys, request limits, the query queue and batch, the worker
    processes, and ingestion jobs and their retries."""

    host: str = Field("127.0.0.1", description="bind address (`kvfuse serve --host` overrides)")
    port: int = Field(8000, ge=1, le=65535, description="bind port (`kvfuse serve --port` overrides)")
    api_keys: Annotated[list[str] | dict[str, KeyScope], NoDecode] = Field([], description=(
        'accepted API keys; env: comma-separated (k1,k2) or a JSON list (["k1", "k2"]), each with full access, '
        'or a JSON object of scoped keys ({"k1": {"collections": ["a"], "access": "read"}}); empty = no auth '
        '(loopback only unless allowed below)'))
    api_keys_file: str = Field("", description=(
        "a JSON or YAML file of API keys, each key -> {collections: [names], access: read | write}; "
        "collections left out = every one, access left out = write (docs/deploy.md, \"Exposing kvfuse\")"))
    allow_unauthenticated_public: bool = Field(False, description=(
        "allow binding a non-loopback address with no API key"))
    metrics_public: bool = Field(False, description=(
        "serve /metrics without an API key (for a Prometheus scrape; the metrics name no document); off, it "
        "answers only a key that sees every collection"))
    max_body_bytes: int = Field(10 * 1024 * 1024, gt=0, description="larger request bodies get 413")
    sse_ping_s: float = Field(15.0, gt=0, description=(
        "seconds between keep-alive comments on a quiet event stream (a long prefill), so proxies keep it open"))
    max_document_chars: int = Field(2_000_000, gt=0, description="larger documents get 413")
    # An uploaded file is parsed in a process of its own (kvfuse/service/rag/parse_pool.py), bounded below:
    # a hostile file is refused with the bound it broke, and the API process never runs a parser.
    upload_parse_workers: int = Field(2, ge=1, description=(
        "processes that parse uploaded files (PDF, DOCX, HTML, ...), at low CPU priority; an upload that "
        "finds none free within upload_parse_timeout_s (and at least a minute) gets 503 parsers_busy"))
    upload_parse_waiters: int = Field(2, ge=0, description=(
        "uploads that may wait for a busy parse process, each holding its file; one more gets 429 "
        "parsers_busy with Retry-After at once"))
    upload_parse_timeout_s: float = Field(60.0, gt=0, description=(
        "a file whose parsing takes longer gets 422 parse_timeout; its parse process is killed and replaced"))
    upload_parse_memory_mb: int = Field(1024, ge=0, description=(
        "address space of each parse process (RLIMIT_AS); a file that needs more gets 413 "
        "parse_memory_exceeded (0 = no limit)"))
    upload_max_decompressed_mb: int = Field(100, gt=0, description=(
        "a file whose content inflates past this (a DOCX's zip members, by declared and by actual size; a "
        "PDF's streams; the text found) gets 413 upload_too_large"))
    upload_max_pages: int = Field(2000, gt=0, description="a PDF with more pages gets 413 too_many_pages")
    upload_max_nesting: int = Field(256, gt=0, description=(
        "an HTML file with elements nested deeper gets 422 too_deeply_nested"))
    max_batch_documents: int = Field(256, gt=0, description="documents per batch ingest request")
    # Bounded under load (docs/DESIGN.md, "Bounded under load"): ingestion jobs wait in a bounded queue
    # shared fairly between API keys (kvfuse/service/rag/ingest_queue.py), and the requests answered at
    # once are bounded in front of every route (kvfuse/service/api/concurrency.py).
    ingest_queue_size: int = Field(1024, ge=1, description=(
        "ingestion jobs (one per document, each of a batch counted) that may wait to run; a request whose "
        "documents do not fit gets 429 ingest_queue_full with Retry-After, and nothing is stored"))
    ingest_queue_key_share: float = Field(0.5, gt=0.0, le=1.0, description=(
        "the share of ingest_queue_size one API key's waiting jobs may take, so a key's flood leaves room "
        "for the others; the keys' jobs run in turn"))
    max_concurrent_requests: int = Field(64, ge=1, description=(
        "requests answered at once (a stream counts until it ends; /health, /ready and /metrics do not "
        "count); one more gets 429 server_busy with Retry-After"))
    max_connections: int = Field(1024, ge=1, description=(
        "open connections the server holds (uvicorn's limit_concurrency); past it uvicorn itself answers "
        "a plain 503"))
    embeddings_max_inputs: int = Field(2048, gt=0, description=(
        "inputs per /v1/embeddings request (OpenAI's limit; LangChain sends 1,000); more get 413"))
    embeddings_max_chars: int = Field(2_000_000, gt=0, description=(
        "characters over all inputs of a /v1/embeddings request; more get 413. It is embedded in slices of "
        "model.embed_batch_size inputs, so a question's embedding waits for one slice, not the request"))
    request_timeout_s: float = Field(300.0, gt=0, description=(
        "a query that runs longer ends with 504 / an SSE error event"))
    queue_size: int = Field(16, ge=1, description="queries waiting for admission beyond this get 429")
    retry_after_s: int = Field(1, ge=0, description="Retry-After header sent with 429")
    ingest_wait_timeout_s: float = Field(600.0, gt=0, description=(
        "`?wait=true` gives up after this long (the job goes on)"))
    job_history_s: float = Field(7 * 86400.0, ge=0, description=(
        "finished ingestion jobs stay readable (GET /v1/jobs/{id}) this long; unfinished ones resume after "
        "a restart"))
    precompute_batch_chunks: int = Field(4, ge=1, description=(
        "chunks per KV precompute job sent to the worker"))
    worker_start_timeout_s: float = Field(300.0, gt=0, description=(
        "ingestion waits this long for the model worker to come up"))
    worker_start_attempts: int = Field(5, ge=1, description=(
        "worker starts in a row that may fail before the model is loaded (a load error, a crash); after the "
        "last one the service stops trying and reports failed (/health 503, `kvfuse worker --health` exit 1)"))
    worker_cancel_grace_s: float = Field(30.0, gt=0, description=(
        "a cancelled job still running after this long gets its worker killed"))
    worker_stop_timeout_s: float = Field(10.0, gt=0, description=(
        "shutdown waits this long for the worker before killing it"))
    workers: int = Field(1, ge=0, description=(
        "local worker processes (one per model.devices entry in turn); 0 = dispatch to `kvfuse worker`s "
        "through Redis (needs redis_url)"))
    max_running_requests: int = Field(16, ge=1, description=(
        "queries decoding together in one batched step; more wait in the queue"))
    max_choices: int = Field(8, ge=1, description=(
        "the most choices (OpenAI's n) one request may ask for; each is a decoding row of its own, holding "
        "prompt + max_tokens of KV"))
    kv_budget_tokens: int = Field(65536, ge=1, description=(
        "a device's KV budget in tokens: running queries (prompt + max_tokens), shadow checks, "
        "ingestion's forwards, cached system prompts and the device tier (store.device_tier_mb) all within "
        "it; local workers sharing a device (server.workers) split it evenly; a query alone over what is "
        "left gets 400"))
    prefill_tokens_per_step: int = Field(2048, ge=1, description=(
        "prefill work per engine step, in prompt tokens through every layer: a long prompt is spread over "
        "steps while running streams decode"))
    ingest_step_share: float = Field(0.25, gt=0.0, le=1.0, description=(
        "share of the worker's time guaranteed to KV precompute while queries run (measured per step)"))
    ingest_layers_per_step: int = Field(4, ge=0, description=(
        "decoder layers of an ingestion piece's forward per engine step, so a query arriving meanwhile "
        "waits for that many layers, not a whole forward; 0: a whole piece in one step"))
    # An ingestion interrupted by something that passes (kvfuse/service/rag/ingest_retry.py) runs again: a
    # worker crash at most ingest_retry_attempts tries in all, an unreachable document index (Redis) at
    # most ingest_index_attempts; the pause before each retry doubles from backoff_s up to backoff_max_s.
    ingest_retry_attempts: int = Field(3, ge=1, description=(
        "tries of an ingestion job that worker crashes interrupt; the last crash fails it with the reason"))
    ingest_index_attempts: int = Field(20, ge=1, description=(
        "tries of an ingestion job while the document index (Redis) does not answer; it waits between them"))
    ingest_retry_backoff_s: float = Field(1.0, ge=0, description=(
        "pause before an ingestion job's first retry; it doubles at each retry"))
    ingest_retry_backoff_max_s: float = Field(30.0, ge=0, description=(
        "the longest pause between an ingestion job's retries"))
    url: str = Field("", description="server URL for `kvfuse ingest/query`; empty = http://<host>:<port>")

    @property
    def base_url(self) -> str:
        """Where clients reach the server: `url`, else http://host:port (a wildcard host means loopback)."""
        if self.url:
            return self.url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().startswith("{"):
            try:
                return json.loads(v)
            except json.JSONDecodeError as err:
                raise ValueError(f"starts with '{{' but is not a JSON object ({err})") from None
        return string_list(v)


class RedisSettings(Section):
    """How kvfuse authenticates to Redis (`redis_url`): every client (the document index, the fleet's job
    streams and heartbeats, the shared chunk KV tier) is built from these by kvfuse/store/redis_access.py.
    A user and password in `redis_url` itself are used as well; giving a password both there and here is
    refused."""

    username: str = Field("", description="ACL user (empty = the URL's, else Redis's `default` user)")
    password: str = Field("", description="password (empty = the URL's or password_file's)")
    password_file: str = Field("", description=(
        "a file holding the password (a docker or Kubernetes secret); surrounding whitespace is dropped"))
    tls_ca_file: str = Field("", description=(
        "CA certificate(s) that sign the server's certificate, for a rediss:// URL (empty = the system's)"))
    tls_cert_file: str = Field("", description="client certificate, when Redis requires one (tls-auth-clients)")
    tls_key_file: str = Field("", description="the client certificate's private key")
    tls_check_hostname: bool = Field(True, description=(
        "require the server certificate to name the URL's host"))


class ObjectStoreSettings(Section):
    """Chunk KV in an S3-compatible object store (AWS S3, MinIO, Ceph, R2, SeaweedFS) beneath every host's
    tiers (kvfuse/store/object_tier.py; docs/DESIGN.md, "Storage"): every chunk stored is written through
    to it, and a chunk no host tier holds is read from it before it is recomputed. Shaped like `redis`:
    credentials from the standard AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY variables, else a
    credentials file."""

    url: str = Field("", description=(
        "s3://bucket/prefix where chunk objects are kept (one object per chunk key); empty = no object store"))
    endpoint: str = Field("", description=(
        "the S3 API's URL, e.g. http://seaweedfs:8333 or https://minio.example:9000 (empty = AWS S3 of region)"))
    region: str = Field("us-east-1", min_length=1, description="the bucket's region (signed into every request)")
    path_style: bool = Field(True, description=(
        "address the bucket in the path (endpoint/bucket/key), as MinIO, Ceph and SeaweedFS expect; off: "
        "virtual-hosted (bucket.endpoint/key)"))
    credentials_file: str = Field("", description=(
        "an AWS shared credentials file (INI: aws_access_key_id, aws_secret_access_key) read when the "
        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY variables are not set; a docker or Kubernetes secret"))
    profile: str = Field("default", min_length=1, description="the section of credentials_file to use")
    ca_file: str = Field("", description=(
        "CA certificate(s) that sign the endpoint's certificate, for an https:// endpoint (empty = the system's)"))
    timeout_s: float = Field(10.0, gt=0, description=(
        "connect and request timeout; past it a read counts as a miss (the chunk is recomputed) and a write "
        "is retried later"))
    write_retry_s: float = Field(30.0, gt=0, description=(
        "how often chunks whose upload failed (the object store down) are tried again"))

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v and (not v.startswith("s3://") or not v[5:].split("/", 1)[0]):
            raise ValueError("must be s3://bucket[/prefix] (or empty for no object store)")
        return v

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https:// (or be empty for AWS S3)")
        return v.rstrip("/")


class FleetSettings(Section):
    """Scale-out over Redis (docs/DESIGN.md, "Scale-out"): `kvfuse serve --workers 0` dispatches to
    `kvfuse worker` processes on any host; used only when `redis_url` is set."""

    namespace: str = Field("kvfuse:fleet", min_length=1, description=(
        "key prefix of the job streams, heartbeats and the shared chunk KV tier"))
    worker_name: str = Field("", description="a worker's name in answers and /ready (empty = host-pid)")
    heartbeat_s: float = Field(1.0, gt=0, description="how often a worker renews its heartbeat")
    heartbeat_ttl_s: float = Field(5.0, gt=0, description=(
        "a worker silent this long is dead: its pending jobs are claimed back"))
    reply_ttl_s: float = Field(30.0, gt=0, description=(
        "a job's reply stream outlives its reader by this much (then the job is dropped)"))
    shared_tier_mb: int = Field(1024, ge=0, description=(
        "cap of the shared chunk KV tier in Redis; past it chunks are evicted by S3-FIFO (0 = off)"))
    redis_kv_with_object_store: bool = Field(False, description=(
        "keep the Redis shared KV tier above the object store when object_store.url is set; off, the object "
        "store is the fleet's shared KV tier (docs/results/object-store/README.md says what was measured)"))
    # Query routing (kvfuse/service/dispatch/routing.py): a worker's score is the share of the query's chunks
    # it holds minus this times its jobs over its running slots; 0 = locality alone.
    route_load_weight: float = Field(8.0, ge=0, description=(
        "a query goes to the worker with the best share of its chunks held minus this x (its jobs / its "
        "max_running_requests); at 16 slots a worker holding every chunk keeps a query until it has 2 jobs "
        "more than one holding none (0 = locality alone)"))
