"""Escape attempts against polyrl.core.sandbox, written as a model would write them.

Each attempt is shown to work without the guarantee (``isolation="none"``, the explicit unsafe
mode, as the control) wherever that is harmless, and to fail in the sandbox.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from polyrl.core.sandbox import (
    SandboxConfig,
    SandboxUnavailable,
    arun_in_sandbox,
    check_sandbox,
    run_in_sandbox,
)

ROOT = Path(__file__).resolve().parents[1]
FAST = SandboxConfig(timeout=10, site_packages=False)
UNSAFE = dataclasses.replace(FAST, isolation="none")


def run(code: str, config: SandboxConfig = FAST, **kw):
    return run_in_sandbox(textwrap.dedent(code), config, **kw)


def host_processes_with(marker: str) -> list[int]:
    """PIDs on the host whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(entry))
    return found


def test_sandbox_is_available_here():
    check_sandbox()
    res = run("import os, socket; print(os.getuid(), os.getgid(), socket.gethostname())")
    assert res.ok and res.output == "1000 1000 sandbox\n"
    caps = run("print([l for l in open('/proc/self/status') if l.startswith('CapEff')][0])")
    assert caps.output.split()[1] == "0000000000000000"  # no capability at all


def test_host_files_are_invisible():
    attempt = f"""
        import os
        for path in [{str(ROOT / "pyproject.toml")!r}, "/etc/passwd", "/proc/{os.getpid()}/cmdline",
                     "/root/.bashrc", "/home"]:
            try:
                print(path, "READ", len(open(path, "rb").read()) if os.path.isfile(path)
                      else os.listdir(path))
            except OSError as exc:
                print(path, type(exc).__name__)
        print(sorted(os.listdir("/")), sorted(p for p in os.listdir("/proc") if p.isdigit()))
        print(os.listdir("/etc") if os.path.isdir("/etc") else [])
    """
    control = run(attempt, UNSAFE)
    assert f"{ROOT / 'pyproject.toml'} READ" in control.output
    assert "/etc/passwd READ" in control.output
    res = run(attempt)
    assert res.ok and "READ" not in res.output, res.output
    assert res.output.count("FileNotFoundError") == 5
    top, etc = res.output.splitlines()[-2:]
    assert "'home'" not in top and "'work'" not in top and "'var'" not in top, top
    assert etc in ("[]", "['ld.so.cache']")  # the dynamic linker's cache, nothing else
    assert top.endswith("['1', '2']")  # only the sandbox's init and the program itself


def test_writes_never_reach_the_host(tmp_path):
    tag = uuid.uuid4().hex
    host_paths = [f"/tmp/escape-{tag}", f"/dev/shm/escape-{tag}", f"/tmp/fifo-{tag}"]
    ctypes_target = str(tmp_path / f"ctypes-{tag}")
    attempt = f"""
        import ctypes, os
        for path in {host_paths[:2]!r}:
            try:
                open(path, "w").write("pwned"); print(path, "WROTE")
            except OSError as exc:
                print(path, type(exc).__name__)
        try:
            os.mkfifo({host_paths[2]!r}); print("FIFO MADE")
        except OSError as exc:
            print("mkfifo", type(exc).__name__)
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.open({ctypes_target!r}.encode(), os.O_WRONLY | os.O_CREAT, 0o644)
        if fd >= 0:
            print("CTYPES WROTE", libc.write(fd, b"pwned", 5))
        else:
            print("ctypes", os.strerror(ctypes.get_errno()))
        try:  # the read-only view of the interpreter
            open(os.path.join(os.path.dirname(os.__file__), "evil.py"), "w")
        except OSError as exc:
            print("stdlib", type(exc).__name__)
    """
    control = run(attempt, UNSAFE)
    try:
        assert "CTYPES WROTE 5" in control.output and os.path.exists(ctypes_target)
    finally:
        for p in [*host_paths, ctypes_target]:
            Path(p).unlink(missing_ok=True)
    res = run(attempt)
    # /tmp and /dev/shm writes land in the sandbox's private tmpfs, gone with it
    assert "CTYPES" not in res.output and "ctypes No such file or directory" in res.output
    assert "stdlib OSError" in res.output and "FIFO MADE" in res.output, res.output
    for p in [*host_paths, ctypes_target]:
        assert not os.path.exists(p), p


def test_fork_bomb_is_bounded():
    attempt = """
        import os, time
        children = []
        try:
            for _ in range(10_000):
                pid = os.fork()
                if pid == 0:
                    time.sleep(30)
                    os._exit(0)
                children.append(pid)
        except OSError as exc:
            print("forked", len(children), "then", type(exc).__name__)
    """
    res = run(attempt, max_procs=8)
    assert res.ok and "then BlockingIOError" in res.output, res.output
    assert int(res.output.split()[1]) == 7  # 8 processes in all, the program included
    assert res.duration_s < 25  # the sleeping children died with the program, not at 30 s


def test_setsid_double_fork_survivor_dies_with_the_call():
    marker = f"survivor-{uuid.uuid4().hex}"
    attempt = f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                null = os.open("/dev/null", os.O_RDWR)  # a daemon: let go of the output pipe
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)",
                                          {marker!r}])
            os._exit(0)
        def running():
            for p in os.listdir("/proc"):
                try:
                    if {marker!r}.encode() in open(f"/proc/{{p}}/cmdline", "rb").read():
                        return True
                except OSError:
                    pass
        for _ in range(500):  # wait until the survivor runs (its argv shows in /proc)
            if running():
                break
            time.sleep(0.01)
        print("spawned")
    """
    control = run(attempt, UNSAFE)
    survivors = host_processes_with(marker)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert control.ok and survivors, "the control attempt should leave a survivor"
    res = run(attempt)
    assert res.ok and res.output == "spawned\n"
    assert host_processes_with(marker) == []  # gone before run_in_sandbox returned


def test_timeout_kills_every_process():
    marker = f"spinner-{uuid.uuid4().hex}"
    attempt = f"""
        import os, sys, time
        for _ in range(3):
            if os.fork() == 0:
                os.setsid()
                os.execv(sys.executable, [sys.executable, "-c", "while True: pass", {marker!r}])
        time.sleep(60)
    """
    res = run(attempt, timeout=1.5, cpu_seconds=30)
    # Killed at its 1.5 s limit, long before its 60 s sleep (the spinners never end).
    assert res.timed_out and res.exit_code is None and res.duration_s < 30
    assert host_processes_with(marker) == []


def test_signals_do_not_reach_outside():
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        attempt = f"""
            import os, signal
            print("ppid", os.getppid())
            for target in (os.getppid(), {sibling.pid}, {os.getpid()}):
                try:
                    os.kill(target, signal.SIGKILL); print("sent", target)
                except OSError as exc:
                    print(target, type(exc).__name__)
            try:  # every process this user may signal: inside, there is none but itself
                os.kill(-1, signal.SIGKILL); print("kill(-1) sent")
            except OSError as exc:
                print("kill(-1)", type(exc).__name__)
            print("alive")
        """
        res = run(attempt)
        # the init (its parent, PID 1) ignored SIGKILL; kill(-1) found nothing to signal
        assert (
            res.output.startswith("ppid 1\nsent 1\n")
            and "kill(-1) ProcessLookupError" in res.output
        )
        assert res.output.endswith("alive\n"), res.output
        assert sibling.poll() is None  # the sibling, and this test process, are alive
        assert f"{sibling.pid} ProcessLookupError" in res.output or (
            # the same number may exist inside: then it is the sandbox's own process
            "sent" in res.output and sibling.pid <= 2
        )
    finally:
        sibling.kill()
        sibling.wait()


def test_concurrent_sandboxes_cannot_see_each_other():
    # Each sandbox writes its files, then looks for the other's every 10 ms for 2 s. The
    # monotonic clock is the host's in every sandbox (no time namespace), so the test checks
    # afterwards that the two windows overlapped: each looked while the other's files existed.
    attempt = """
        import os, time
        me, other = {me!r}, {other!r}
        theirs = (f"/tmp/{{other}}", f"/dev/shm/{{other}}")
        open(f"/tmp/{{me}}", "w").write("secret")
        open(f"/dev/shm/{{me}}", "w").write("secret")
        start = time.monotonic()
        seen = False
        while time.monotonic() < start + 2.0:
            seen = seen or any(os.path.exists(path) for path in theirs)
            time.sleep(0.01)
        print("seen", seen)
        print("window", start, time.monotonic())
        print(sorted(os.listdir("/tmp")), sorted(p for p in os.listdir("/proc") if p.isdigit()))
    """
    a, b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"

    async def both():
        return await asyncio.gather(
            arun_in_sandbox(textwrap.dedent(attempt.format(me=a, other=b)), FAST),
            arun_in_sandbox(textwrap.dedent(attempt.format(me=b, other=a)), FAST),
        )

    ra, rb = asyncio.run(both())
    windows = []
    for res, me in ((ra, a), (rb, b)):
        assert res.ok and "seen False\n" in res.output, res.output
        assert res.output.splitlines()[-1] == f"{sorted(['main.py', me])} ['1', '2']"
        windows.append([float(x) for x in res.output.splitlines()[1].split()[1:]])
    (start_a, end_a), (start_b, end_b) = windows
    assert max(start_a, start_b) + 0.1 < min(end_a, end_b), ("not alive together", windows)
    assert not os.path.exists(f"/tmp/{a}") and not os.path.exists(f"/dev/shm/{b}")


def test_disk_quota():
    tag = uuid.uuid4().hex
    attempt = f"""
        import errno
        written = 0
        try:
            with open("/tmp/{tag}", "wb") as f:
                for _ in range(64):
                    f.write(b"x" * (1 << 20)); f.flush(); written += 1
        except OSError as exc:
            print("wrote", written, "MiB then", errno.errorcode[exc.errno])
    """
    res = run(attempt, disk_mb=8)
    assert res.ok and "then ENOSPC" in res.output, res.output
    assert int(res.output.split()[1]) <= 8
    assert not os.path.exists(f"/tmp/{tag}")


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    accepted: list = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            accepted.append(1)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1], accepted
    stop.set()
    t.join()
    srv.close()


def test_network_is_unreachable(listener):
    port, accepted = listener
    attempt = f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2); print("CONNECTED")
        except OSError as exc:
            print(type(exc).__name__, exc)
    """
    assert run(attempt, UNSAFE).output == "CONNECTED\n"
    res = run(attempt)
    assert "CONNECTED" not in res.output and "unreachable" in res.output, res.output
    time.sleep(0.2)
    assert len(accepted) == 1  # only the control's connection


def test_limits_and_output_cap():
    mem = run("x = bytearray(1 << 30)\nprint('allocated')", memory_mb=256)
    assert mem.exit_code == 1 and "MemoryError" in mem.output
    # (RLIMIT_CPU itself: tests/test_agent_tools.py; one CPU second is slow on a loaded box)
    killed = run("import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)")
    assert killed.signal == "SIGXCPU" and killed.exit_code is None and not killed.ok
    big = run("print('a' * 100000)", max_output_bytes=1000)
    assert big.ok and big.output == "a" * 1000 and big.output_bytes == 100001 and big.truncated
    with pytest.raises(ValueError, match="isolation must be"):
        SandboxConfig(isolation="chroot")


def test_missing_user_namespaces_fail_loudly():
    """With user namespaces disabled (max_user_namespaces=0 in an outer user namespace), the
    sandbox refuses to run and says what to enable; no silent fallback."""
    probe = "from polyrl.core.sandbox import check_sandbox; check_sandbox()"
    script = f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -c '{probe}'"
    try:
        out = subprocess.run(
            ["unshare", "--user", "--map-root-user", "sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    except FileNotFoundError:
        pytest.skip("no unshare(1) here")
    assert out.returncode != 0
    assert SandboxUnavailable.__name__ in out.stderr, out.stderr
    assert "unshare(user, mount, pid" in out.stderr and "isolation='none'" in out.stderr


def test_cancelling_the_call_kills_the_sandbox():
    marker = f"cancelled-{uuid.uuid4().hex}"
    attempt = f"""
        import os, sys
        if os.fork() == 0:
            os.setsid()
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)",
                                      {marker!r}])
        import time; time.sleep(30)
    """

    async def cancelled():
        task = asyncio.ensure_future(arun_in_sandbox(textwrap.dedent(attempt), FAST))
        for _ in range(300):  # until the survivor-to-be runs
            await asyncio.sleep(0.01)
            if host_processes_with(marker):
                break
        assert host_processes_with(marker)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    # the launcher was killed; its child and the namespace's init follow (parent-death signal)
    deadline = time.monotonic() + 3
    while host_processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert host_processes_with(marker) == []
