"""What a benchmark ran on and how it was invoked: recorded in every result file.

Benchmarks run from the repository root: the commit is the working directory's, and paths in the
recorded command are written relative to it, as they were typed."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    return {
        **{f"{k}_at_start": v for k, v in load_info().items()},
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "git_commit": git_commit(),
    }


def load_info() -> dict[str, Any]:
    """Load average of the machine (1 min) now: timings taken on a busy shared machine say so."""
    try:
        return {"load_avg_1m": round(os.getloadavg()[0], 2)}
    except OSError:
        return {}


def _render(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ",".join(_render(v) for v in value)
    if isinstance(value, float):
        return format(value, "g")
    text = str(value)
    if os.path.isabs(text) and Path(text).is_relative_to(Path.cwd()):  # as typed from the working directory
        return os.path.relpath(text)
    return text


_SECRET_WORDS = frozenset({"KEY", "KEYS", "SECRET", "SECRETS", "PASSWORD", "PASSWORDS", "CREDENTIALS"})


def _secret(name: str, value: str) -> bool:
    """Whether an environment setting may hold a secret: API keys, passwords, an access token, or a URL
    with credentials in it. Token counts (CHUNK_TOKENS, MAX_TOKENS ...) are settings, not secrets."""
    words = set(name.split("_"))
    return bool(words & _SECRET_WORDS) or "TOKEN" in words or "@" in value


def command_line(prog: str, parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The command with every option spelled out as it took effect (defaults included), so the result
    says exactly how to reproduce it whatever the defaults become."""
    # settings overridden from the environment change the run too; secrets are never written down
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k.startswith("KVFUSE_") and not _secret(k, v)]
    parts = [*env, prog]
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, None)
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                parts.append(flag)
        elif value is not None and value != []:
            if isinstance(action, argparse._AppendAction):
                value = [x for group in value for x in (group if isinstance(group, list) else [group])]
            parts += [flag, shlex.quote(_render(value))]
    return " ".join(parts)
