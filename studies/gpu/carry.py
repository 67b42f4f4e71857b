"""The wheels a GPU host's image lacks for kvfuse, resolved with their dependencies for that image's Python.

The host reaches no package index, so what kvfuse needs beyond the image must be carried. Every pinned
requirement is carried at its pin (the image's CUDA torch and numpy excepted: they come with the
image); then each carried wheel's dependencies (its Requires-Dist, markers evaluated for the image's
Python on Linux x86_64), recursively: a dependency the image holds stays the image's when its version
there satisfies the requirement (or is not known), else the version it needs is carried too.
Writes the wheels into OUT and OUT/CARRIED.txt (the image's python, torch and transformers beside the
pins, what was carried and why, what the image supplies).

    python studies/gpu/carry.py OUT --python 3.12 --image studies/gpu/image-packages.txt -r REQS...
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "any")
FROM_IMAGE = {"torch", "numpy", "triton"}  # CUDA-coupled: always the image's own


def read_image(path: Path) -> dict[str, Version | None]:
    out: dict[str, Version | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = Version(version) if version else None
    return out


def download(req: Requirement, python: str, out: Path) -> Path:
    """One wheel for `req` (no dependencies) for the image's Python; its path."""
    before = set(out.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", "-d", str(out), str(req)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd, check=True)
    name = canonicalize_name(req.name)
    found = [w for w in out.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) == name]
    new = [w for w in found if w not in before] or found
    return new[0]


def requires(wheel: Path, env: dict) -> list[Requirement]:
    """The wheel's dependencies that apply in `env` (no extras)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    out = []
    for line in msg.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
            out.append(req)
    return out


def resolve(pins: list[Requirement], image: dict[str, Version | None], python: str, out: Path) -> list[str]:
    env = {**default_environment(), "python_version": python, "python_full_version": f"{python}.0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
    carried: dict[str, Version] = {}
    notes: list[str] = []
    queue = [(r, "pinned") for r in pins if canonicalize_name(r.name) not in FROM_IMAGE]
    while queue:
        req, why = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in carried:
            if carried[name] not in req.specifier:
                raise SystemExit(f"{req} ({why}) conflicts with the carried {name}=={carried[name]}")
            continue
        if why != "pinned" and name in image:
            have = image[name]
            if name in FROM_IMAGE or have is None or have in req.specifier:
                notes.append(f"image  {name}{'==' + str(have) if have else ''}  ({req} for {why})")
                continue
        wheel = download(req, python, out)
        carried[name] = Version(wheel.name.split("-")[1])
        notes.append(f"carry  {wheel.name}  ({why})")
        queue += [(dep, name) for dep in requires(wheel, env)]
    return notes


REPORTED = ("torch", "transformers")  # beside python: what the static decode path depends on


def versions(pins: list[Requirement], image: dict[str, Version | None], python: str) -> list[str]:
    """What the image holds of python, torch and transformers beside the project's pins, and which of the
    two a run there uses (kvfuse/fusion/engine/static_support.py refuses a torch its static path cannot use)."""
    pinned = {canonicalize_name(r.name): str(r.specifier) for r in pins}
    out = [f"version  python  image {python}  project >=3.11 (Dockerfile 3.11)  runs the image's"]
    for name in REPORTED:
        have = image.get(name)
        uses = "the image's (CUDA-coupled)" if name in FROM_IMAGE else "the carried pin"
        out.append(f"version  {name}  image {have or 'unknown'}  pinned {pinned.get(name, '-')}  runs {uses}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--python", default="3.12")
    ap.add_argument("--image", default="studies/gpu/image-packages.txt")
    ap.add_argument("-r", dest="reqs", action="append", required=True)
    ap.add_argument("--skip", action="append", default=[], help="pinned names not to carry")
    args = ap.parse_args()
    skip = {canonicalize_name(s) for s in args.skip}
    pins = [Requirement(line.split("#")[0].strip()) for f in args.reqs for line in Path(f).read_text().splitlines()
            if line.split("#")[0].strip()]
    pins = [p for p in pins if canonicalize_name(p.name) not in skip]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    image = read_image(Path(args.image))
    notes = versions(pins, image, args.python) + resolve(pins, image, args.python, out)
    (out / "CARRIED.txt").write_text("\n".join(notes) + "\n")
    print("\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
