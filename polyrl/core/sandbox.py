"""Run untrusted (model-written) Python code in a sandbox built from Linux namespaces.

Every place that runs model-written code goes through :func:`run_in_sandbox` (or its async twin
:func:`arun_in_sandbox`): the agent's ``python`` tool today, a code-execution reward tomorrow
(this module sits in :mod:`polyrl.core` so services may use it).

How: a small launcher (``_sandbox_launcher.py``, standard library only) is started per call. It
creates new user, mount, PID, network, IPC, UTS and cgroup namespaces with ``unshare(2)`` (an
unprivileged user namespace: no root, setuid helper, bubblewrap or nsjail needed), builds a new
root on a tmpfs, pivots into it (``pivot_root``) and runs the code in a fresh interpreter as
PID 2, under an init of ours as PID 1. Per call it costs the launcher's and the interpreter's
start-up (tens of milliseconds) plus a few milliseconds of namespace and mount set-up.

What it guarantees (each is tested in ``tests/test_sandbox.py`` as an escape attempt):

* **Files**: the code sees a minimal read-only tree: the interpreter binary, its standard
  library and ``libpython`` directory, the shared library directories (``/usr/lib``, ``/lib``
  and their 64-bit twins), optionally the current environment's ``site-packages``
  (``site_packages=True``, the default) and ``/etc/ld.so.cache``; nothing
  else of the host (no project directory, ``/home``, ``/root``, ``/etc``, ``/var``,
  ``/usr/bin``). ``/dev`` has only ``null``, ``zero``, ``full``, ``random`` and ``urandom``;
  ``/proc`` is a fresh one that shows only the sandbox's processes.
* **Writes**: the only writable place is a private tmpfs of ``disk_mb`` MiB (``/tmp``, which
  is also the working directory and ``/dev/shm``), mounted ``nosuid,nodev,noexec``; writing more
  fails with ``ENOSPC``. It lives in the sandbox's mount namespace, so it disappears with the
  sandbox and is never on the host's disk. The host sees no write at all, whatever the API used
  (``open``, ctypes, ``mkfifo``...): the kernel enforces it, not a Python hook.
* **Identity**: inside, the code runs as uid/gid 1000, the only ids mapped (there is no root
  inside); outside, that is the caller's uid, or ``nobody`` (65534) when the caller is root. It
  has no capabilities (a non-zero uid keeps none across ``execve``) and ``no_new_privs``.
* **Processes**: at most ``max_procs`` processes *and threads* (``RLIMIT_NPROC``, which the
  kernel counts per user namespace, so each sandbox has its own budget; no cgroup needed).
  Every process the code starts dies with the sandbox: when the code's main process exits, or
  at the wall-clock timeout, the namespace's init exits and the kernel kills everything left in
  the PID namespace (double-forked, ``setsid`` or not) before the call returns.
* **Signals**: processes outside are invisible (PID namespace): ``kill(getppid())`` targets
  our init (which ignores it), ``kill(-1)`` reaches only the sandbox's own processes.
* **Sandboxes are invisible to one another**: separate PID, mount, IPC and network namespaces
  and separate tmpfs; two concurrent calls cannot see each other's files or processes.
* **Network**: a new network namespace with no interface up: no connection to anything,
  loopback included. **IPC**: a new IPC namespace (System V and POSIX message queues).
* **Resources**: ``RLIMIT_CPU`` (``cpu_seconds``, CPU time, per process), ``RLIMIT_AS``
  (``memory_mb``, per process), ``RLIMIT_FSIZE``, no core dumps, ``RLIMIT_NOFILE``, a
  wall-clock ``timeout`` for the whole sandbox, and the output kept is capped
  (``max_output_bytes``; the rest is read and counted, never stored).

What it does not guarantee:

* No seccomp filter: the code may make any system call the kernel allows an unprivileged user
  in a user namespace, so a kernel bug is an escape (the kernel is the attack surface, as for
  any namespace sandbox). Use a VM (gVisor, Firecracker) where that matters.
* Memory is limited per process (address space), not in total: the whole sandbox may use up
  to about ``max_procs * memory_mb`` plus ``disk_mb`` of tmpfs (tmpfs is memory). A memory
  cgroup is not used (it needs cgroup delegation, which unprivileged users rarely have).
* ``cpu_seconds`` is CPU time per process, not wall time; the wall-clock bound is ``timeout``.
* The read-only tree is readable: the interpreter, its standard library, the shared libraries
  and (by default) the installed packages of the current environment.
* It needs Linux with unprivileged user namespaces (and a fully visible ``/proc``, which
  Docker's default masked paths prevent). Where they are missing the call raises
  :class:`SandboxUnavailable` naming what is missing; nothing falls back to an unsafe mode
  unless the caller asks for ``isolation="none"``, which only applies the rlimits and a
  temporary directory: UNSAFE, the code can then read and write whatever the caller can.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import functools
import json
import marshal
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = [
    "ISOLATIONS",
    "SandboxConfig",
    "SandboxError",
    "SandboxResult",
    "SandboxUnavailable",
    "arun_in_sandbox",
    "check_sandbox",
    "run_in_sandbox",
]

#: ``"namespaces"``: the sandbox described above; ``"none"``: rlimits only (UNSAFE).
ISOLATIONS = ("namespaces", "none")

_LAUNCHER = str(Path(__file__).with_name("_sandbox_launcher.py"))
_LIB_DIRS = ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64")
_DEVICES = ("null", "zero", "full", "random", "urandom")
_STATUS_LIMIT = 1 << 16
_GRACE_S = 5.0  # the launcher enforces the timeout; we kill it only if it overruns by this

_HINT = (
    "polyrl's sandbox needs Linux unprivileged user namespaces (with mount, PID, network, "
    "IPC and UTS namespaces). To enable them: `sysctl -w kernel.unprivileged_userns_clone=1` "
    "(Debian, older Ubuntu), `sysctl -w user.max_user_namespaces=10000` (when it is 0), "
    "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` (Ubuntu 23.10+); in Docker, "
    "the default seccomp profile and masked /proc paths block them: run the container with "
    "`--security-opt seccomp=unconfined --security-opt systempaths=unconfined` (or "
    "--privileged). Or pass isolation='none' to run the code WITHOUT isolation (unsafe: it "
    "can read and write everything this user can)."
)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code run in it)."""


class SandboxUnavailable(SandboxError):
    """The sandbox cannot be built here (namespaces missing or restricted)."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits and options of a sandbox; every field is also a keyword of :func:`run_in_sandbox`.

    Attributes:
        timeout: wall-clock seconds for the whole sandbox; then every process in it is killed.
        memory_mb: address-space limit of each process (``RLIMIT_AS``).
        disk_mb: size of the private writable tmpfs (``/tmp``, the working directory).
        max_procs: processes and threads the code may have at once, its main one included.
        cpu_seconds: CPU-time limit of each process (``SIGXCPU``).
        file_size_mb: largest file (``RLIMIT_FSIZE``); default ``disk_mb``.
        max_open_files: ``RLIMIT_NOFILE``.
        max_output_bytes: bytes of output kept (the rest is counted in ``output_bytes``).
        isolation: ``"namespaces"``, or ``"none"``: UNSAFE, rlimits and a temporary directory
            only, for machines without user namespaces, by explicit choice.
        python: the interpreter (default: this one; its base installation is what runs).
        site_packages: expose that environment's site-packages (read-only) to the code.
        ro_binds: more host paths to expose read-only (e.g. ``"/usr/bin"`` for a shell).
        preamble: Python source run in the sandboxed interpreter before the code (e.g. to
            install an audit hook).
    """

    timeout: float = 10.0
    memory_mb: int = 512
    disk_mb: int = 64
    max_procs: int = 16
    cpu_seconds: int = 10
    file_size_mb: int | None = None
    max_open_files: int = 256
    max_output_bytes: int = 1 << 16
    isolation: str = "namespaces"
    python: str | None = None
    site_packages: bool = True
    ro_binds: tuple[str, ...] = ()
    preamble: str = ""

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, got {self.isolation!r}")
        for name in (
            "timeout",
            "memory_mb",
            "disk_mb",
            "max_procs",
            "cpu_seconds",
            "file_size_mb",
            "max_open_files",
            "max_output_bytes",
        ):
            value = getattr(self, name)
            if value is None and name == "file_size_mb":
                continue
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        object.__setattr__(self, "ro_binds", tuple(self.ro_binds))


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed run ended.

    Attributes:
        output: stdout and stderr interleaved, decoded (UTF-8, errors replaced), at most
            ``max_output_bytes`` bytes of it.
        output_bytes: how many bytes the code wrote in all.
        exit_code: the code's exit status, ``None`` when a signal or the timeout ended it.
        signal: the name of the signal that killed it (``"SIGXCPU"``: CPU time limit).
        timed_out: the wall-clock timeout killed the sandbox.
        duration_s: wall-clock seconds of the call.
    """

    output: str
    output_bytes: int
    exit_code: int | None
    signal: str | None
    timed_out: bool
    duration_s: float

    @property
    def ok(self) -> bool:
        """Whether the code ran to completion and exited with status 0."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def truncated(self) -> bool:
        """Whether :attr:`output` lacks part of what the code wrote."""
        return self.output_bytes > len(self.output.encode("utf-8", errors="replace"))


def _covered(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


_PROBE = (
    "import json, site, sys, sysconfig; p = sysconfig.get_paths(vars={'base': sys.base_prefix, "
    "'platbase': sys.base_exec_prefix}); print(json.dumps(["
    "[p['stdlib'], p['platstdlib'], sysconfig.get_config_var('LIBDIR') or p['stdlib']], "
    "site.getsitepackages() if hasattr(site, 'getsitepackages') else []]))"
)


@functools.cache
def _mounts(python: str, site_packages: bool, ro_binds: tuple[str, ...]) -> dict[str, Any]:
    """Find the host paths ``python`` needs in the sandbox: binds, symlinks, sys.path."""
    probe = subprocess.run([python, "-I", "-c", _PROBE], capture_output=True, text=True, check=True)
    stdlib, site_dirs = json.loads(probe.stdout)
    exe = os.path.realpath(python)
    symlinks: dict[str, str] = {}
    wanted: list[str] = [exe, "/etc/ld.so.cache"]
    for d in _LIB_DIRS:
        if os.path.islink(d):
            symlinks[d] = os.readlink(d)
        elif os.path.isdir(d):
            wanted.append(d)
    extra: list[str] = []
    if site_packages:
        extra = [os.path.realpath(p) for p in site_dirs if os.path.isdir(p)]
        extra += _pth_dirs(extra)
    wanted += [os.path.realpath(p) for p in [*stdlib, *extra, *ro_binds]]
    binds: list[str] = []  # parents before children; a path under another one is not bound
    for path in sorted(set(wanted), key=len):
        if os.path.exists(path) and not _covered(path, binds):
            binds.append(path)
    return {"exe": exe, "binds": binds, "symlinks": symlinks, "path": extra}


def _pth_dirs(site_dirs: list[str]) -> list[str]:
    """Directories named by ``.pth`` lines (not ``import`` lines: nothing runs at start-up)."""
    found: list[str] = []
    for d in site_dirs:
        for name in sorted(os.listdir(d)):
            if not name.endswith(".pth"):
                continue
            with contextlib.suppress(OSError, UnicodeDecodeError):
                for line in Path(d, name).read_text().splitlines():
                    line = line.strip()
                    if line and not line.startswith(("#", "import ", "import\t")):
                        p = os.path.realpath(os.path.join(d, line))
                        if os.path.isdir(p) and p not in found and p not in site_dirs:
                            found.append(p)
    return found


def _boot(path: list[str], preamble: str) -> str:
    """Return the program for ``python -S -c``: sys.path, the preamble, then main.py."""
    return (
        "import sys\n"
        f"sys.path.extend({path!r})\n"
        f"exec(compile({preamble!r}, '<preamble>', 'exec'), {{}})\n"
        "with open('main.py', encoding='utf-8') as _f:\n"
        "    _code = compile(_f.read(), 'main.py', 'exec')\n"
        "exec(_code, {'__name__': '__main__', '__builtins__': __builtins__})\n"
    )


def _prepare(code: str, config: SandboxConfig) -> tuple[list[str], bytes, dict[str, str]]:
    """Return the launcher's argv, stdin (config and code, marshalled) and environment."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    m = _mounts(config.python or sys.executable, bool(config.site_packages), config.ro_binds)
    disk_mb = int(config.disk_mb)
    cfg = {
        "isolation": config.isolation,
        "parent": os.getpid(),
        "timeout": float(config.timeout),
        "cpu_seconds": max(1, int(config.cpu_seconds)),
        "memory_bytes": int(config.memory_mb) << 20,
        "file_size_bytes": int(config.file_size_mb or disk_mb) << 20,
        "max_procs": int(config.max_procs),
        "max_open_files": int(config.max_open_files),
        "disk_mb": disk_mb,
        "inodes": max(1024, 64 * disk_mb),
        "exe": m["exe"],
        "binds": m["binds"],
        "symlinks": m["symlinks"],
        "devices": list(_DEVICES),
        "boot": _boot(m["path"], config.preamble),
        "env": {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp",
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        },
    }
    argv = [m["exe"], "-I", "-S", _LAUNCHER]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    return argv, marshal.dumps((cfg, code.encode("utf-8"))), env


def _result(out: bytes, total: int, status: bytes, rc: int | None, start: float) -> SandboxResult:
    lines = status.decode("utf-8", errors="replace").strip().splitlines()
    try:
        report = ast.literal_eval(lines[-1]) if lines else None
    except (ValueError, SyntaxError):
        report = None
    if not isinstance(report, dict) or rc != 0:
        raise SandboxError(f"the sandbox launcher failed (exit {rc}): {' '.join(lines)[-2000:]}")
    if "error" in report:
        if report.get("unavailable"):
            raise SandboxUnavailable(f"{report['error']}. {_HINT}")
        raise SandboxError(report["error"])
    sig = report.get("signal")
    return SandboxResult(
        output=out.decode("utf-8", errors="replace"),
        output_bytes=total,
        exit_code=report.get("exit_code"),
        signal=signal.Signals(sig).name if sig else None,
        timed_out=bool(report.get("timed_out")),
        duration_s=time.monotonic() - start,
    )


def _config(config: SandboxConfig | None, overrides: dict[str, Any]) -> SandboxConfig:
    return dataclasses.replace(config or SandboxConfig(), **overrides)


def run_in_sandbox(
    code: str, config: SandboxConfig | None = None, **overrides: Any
) -> SandboxResult:
    """Run Python ``code`` in a fresh sandbox (see the module docstring) and wait for it.

    Args:
        code: the program's source (run as ``__main__`` from ``/tmp/main.py``).
        config: limits and options (default :class:`SandboxConfig`).
        **overrides: fields of :class:`SandboxConfig` to change, e.g. ``timeout=5``.

    Raises:
        SandboxUnavailable: the machine lacks what the sandbox needs (the message says what
            and how to enable it).
        SandboxError: the sandbox failed for another reason.
    """
    config = _config(config, overrides)
    argv, stdin, env = _prepare(code, config)
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=env,
    )
    try:
        assert proc.stdin and proc.stdout and proc.stderr
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write(stdin)
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
        out_fd, status_fd = proc.stdout.fileno(), proc.stderr.fileno()
        kept = {out_fd: bytearray(), status_fd: bytearray()}
        caps = {out_fd: int(config.max_output_bytes), status_fd: _STATUS_LIMIT}
        total = 0
        deadline = start + float(config.timeout) + _GRACE_S
        with selectors.DefaultSelector() as sel:
            for fd in kept:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SandboxError(
                        f"the sandbox launcher overran its {config.timeout:g} s timeout"
                    )
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fd)
                        continue
                    total += len(chunk) if key.fd == out_fd else 0
                    buf = kept[key.fd]
                    buf.extend(chunk[: max(0, caps[key.fd] - len(buf))])
        rc = proc.wait(max(0.1, deadline - time.monotonic()))
        return _result(bytes(kept[out_fd]), total, bytes(kept[status_fd]), rc, start)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()


async def arun_in_sandbox(
    code: str, config: SandboxConfig | None = None, **overrides: Any
) -> SandboxResult:
    """:func:`run_in_sandbox` for asyncio; cancelling it kills the sandbox."""
    config = _config(config, overrides)
    argv, stdin, env = _prepare(code, config)
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        env=env,
    )
    total = 0

    async def read(stream: asyncio.StreamReader | None, cap: int, count: bool) -> bytes:
        nonlocal total
        assert stream is not None
        buf = bytearray()
        while chunk := await stream.read(65536):
            total += len(chunk) if count else 0
            buf.extend(chunk[: max(0, cap - len(buf))])
        return bytes(buf)

    async def feed() -> None:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(stdin)
            await proc.stdin.drain()
            proc.stdin.close()

    try:
        out, status, _, rc = await asyncio.wait_for(
            asyncio.gather(
                read(proc.stdout, int(config.max_output_bytes), True),
                read(proc.stderr, _STATUS_LIMIT, False),
                feed(),
                proc.wait(),
            ),
            float(config.timeout) + _GRACE_S,
        )
    except TimeoutError:
        raise SandboxError(
            f"the sandbox launcher overran its {config.timeout:g} s timeout"
        ) from None
    finally:
        if proc.returncode is None:  # also on cancellation: never leave the sandbox running
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                await proc.wait()
    return _result(out, total, status, rc, start)


@functools.cache
def check_sandbox(isolation: str = "namespaces") -> None:
    """Run an empty program once (cached); raise :class:`SandboxUnavailable` where it cannot."""
    result = run_in_sandbox("pass", timeout=30, isolation=isolation, site_packages=False)
    if not result.ok:
        raise SandboxError(f"the sandbox cannot run an empty program: {result.output[-2000:]}")
