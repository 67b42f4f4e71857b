"""The tests' real S3 server: SeaweedFS on loopback ports (kvfuse/bench/seaweedfs.py, which
`kvfuse bench corpus` starts too)."""

from kvfuse.bench.seaweedfs import ACCESS_KEY, GRPC_OFFSET, SECRET_KEY, SeaweedFS, free_port_pair, weed_binary

__all__ = ["ACCESS_KEY", "GRPC_OFFSET", "SECRET_KEY", "SeaweedFS", "free_port_pair", "weed_binary"]
