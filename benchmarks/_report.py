"""Shared ending of every benchmark script: record the result and print it last.

:func:`report` takes the script's result (``name``, its raw figures and ``ratio``, > 1 meaning
polyrl beat the baseline measured in the same run), adds ``date`` (UTC, ISO 8601), ``machine``
(a short description of this host), ``command`` and ``git_commit``/``git_dirty`` (when the
script runs from a git checkout), appends that record as one JSON line to
``benchmarks/history/<name>.jsonl`` and prints the same record as the last stdout line.

``POLYRL_BENCH_HISTORY`` redirects the history to another directory; set it to ``0`` (or the
empty string) to print without recording, e.g. for smoke runs with tiny options.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
HISTORY_DIR = HERE / "history"
METADATA = ("date", "machine", "command", "git_commit", "git_dirty")


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> int | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> str:
    # Only asks torch when the benchmark already imported it; never initialises CUDA itself.
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            return ", ".join(f"{names.count(n)}x {n}" for n in dict.fromkeys(names))
    except Exception:  # a broken driver must not lose the result
        pass
    return "no GPU"


def machine() -> str:
    """Short description of this host, e.g. ``AMD EPYC 7B13, 2 CPUs, 24 GiB, no GPU``."""
    parts = [_cpu_model() or platform.machine(), f"{os.cpu_count()} CPUs"]
    memory = _memory_gib()
    if memory is not None:
        parts.append(f"{memory} GiB")
    parts.append(_gpus())
    return ", ".join(parts)


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", *args], cwd=HERE, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip()


def command() -> str:
    """The command line that ran the benchmark, script path relative to the repository."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(HERE.parent)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def with_metadata(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` followed by ``date``, ``machine``, ``command`` and, in a checkout, git."""
    record = {k: v for k, v in result.items() if k not in METADATA}
    record["date"] = datetime.now(UTC).isoformat(timespec="seconds")
    record["machine"] = machine()
    record["command"] = command()
    commit = _git("rev-parse", "HEAD")
    if commit:
        record["git_commit"] = commit
        status = _git("status", "--porcelain", "--untracked-files=no")
        if status is not None:
            record["git_dirty"] = bool(status)
    return record


def history_dir() -> Path | None:
    """Where history files go; ``None`` when ``POLYRL_BENCH_HISTORY`` turns recording off."""
    value = os.environ.get("POLYRL_BENCH_HISTORY")
    if value is None:
        return HISTORY_DIR
    if value.strip() in ("", "0"):
        return None
    return Path(value)


def report(result: dict[str, Any]) -> None:
    """Append ``result`` plus metadata to its history file and print it as the last line."""
    if "name" not in result or "ratio" not in result:
        raise ValueError(f"a benchmark result needs 'name' and 'ratio': {sorted(result)}")
    record = with_metadata(result)
    line = json.dumps(record)
    directory = history_dir()
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        with (directory / f"{record['name']}.jsonl").open("a") as f:
            f.write(line + "\n")
    sys.stdout.flush()
    print(line, flush=True)
