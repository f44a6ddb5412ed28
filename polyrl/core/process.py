"""Child processes a polyrl process owns: free ports, process groups, servers tied to us.

:func:`free_port` finds a TCP port to hand a child, :func:`kill_group` signals a child's whole
process group, and :func:`spawn_group` launches a server in a process group of its own that
the kernel ends when this process dies. The subprocess rollout backends, the weight transports
and the training engine's rendezvous use them. :func:`plain_log_lines` reads a child's log for
a message: without colour codes and Ray's bookkeeping lines.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["free_port", "kill_group", "plain_log_lines", "spawn_group"]

#: An ANSI escape sequence (colours, cursor moves) as Ray, tqdm and servers write them.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: Lines Ray writes into actor logs for its own bookkeeping (``:actor_name:_RayHost``).
_RAY_MARKERS = (":actor_name:", ":task_name:", ":job_id:")

# Run first in the child: ask the kernel for SIGTERM when the parent dies (PR_SET_PDEATHSIG), so
# that a crashed or SIGKILLed polyrl process leaves no server behind; then exec the real command.
# The parent's pid is checked after prctl because the parent may have died before it ran.
_PDEATHSIG_STUB = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('polyrl parent exited before the server started')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def plain_log_lines(text: str) -> list[str]:
    """``text``'s non-empty lines as a person reads them: no colour codes, no redrawn bars.

    Of a line redrawn with carriage returns (a progress bar) only the last state stays; Ray's
    marker lines (``:actor_name:...``) go.
    """
    out = []
    for raw in text.split("\n"):  # not splitlines(): a lone "\r" redraws the same line
        line = _ANSI.sub("", raw.rstrip("\r").rsplit("\r", 1)[-1]).rstrip()
        if line and not line.startswith(_RAY_MARKERS):
            out.append(line)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago.

    Another process may take it before the caller binds it: callers that launch a server on
    it retry with another port when the server reports the address in use.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def kill_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid``; a group already gone is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def spawn_group(
    cmd: Sequence[str],
    *,
    python: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    env: Mapping[str, str],
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new process group that gets ``SIGTERM`` when this process dies.

    ``python`` (any interpreter: the server's own venv's is fine) runs a short stub that sets
    the parent-death signal and then execs ``cmd``, so the server keeps its pid and leads its
    group: :func:`kill_group` on that pid also reaches the workers it forks. Output (stdout
    and stderr) is appended to ``log_path``, after a line naming the command. The parent-death
    signal is tied to the calling *thread*: call this from one that outlives the child.
    """
    stub = [str(python), "-c", _PDEATHSIG_STUB, str(os.getpid())]
    with open(Path(log_path), "ab") as log:
        log.write(f"\n# polyrl: {shlex.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(
            [*stub, *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env),
            start_new_session=True,
        )
