"""A same-node fast path to the transfer controller: pickled calls over a Unix socket.

Every Ray actor call costs a task submission, a scheduling hop and a reply through each
process's core worker; on a loaded node that is milliseconds per hop, and the queue's hot path
(a producer commits a block, a waiting consumer's ``get_meta`` returns) is two such hops. The
controller therefore also serves its two hot calls on a Unix socket, on its own event loop, so
they see the same metadata and wake the same waiting consumers as Ray calls do. Clients on the
controller's node use the socket; others (and anything that fails to connect) use Ray.

What crosses the socket is plain pickled data: only :data:`FAST_METHODS` can be called, and
they neither take nor return ``ObjectRef`` (pickling one outside Ray would pin its object for
good). The socket lives in a private directory (mode 0700) named after the controller's pid,
so :func:`polyrl.core.shm.sweep_dead` removes it if the controller was killed.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import pickle
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

from polyrl.core.shm import sweep_dead
from polyrl.transfer.base import TransferError

__all__ = ["FAST_METHODS", "FastPathClient", "FastPathServer", "FastPathUnavailable"]

#: Controller methods served on the socket (async methods taking and returning plain data).
FAST_METHODS = frozenset({"commit_new", "get_meta_local"})
SOCKET_DIR_PREFIX = "polyrl-tqsock-"
_LEN = 8  # bytes of the little-endian length before each pickled frame


class FastPathUnavailable(ConnectionError):
    """The server could not be reached; nothing was sent, so the call may go through Ray."""


def _frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(_LEN, "little") + data


class FastPathServer:
    """Serves ``target``'s :data:`FAST_METHODS` on a Unix socket, on the running event loop.

    Args:
        target: the object whose async methods are called (the controller).
    """

    def __init__(self, target: Any) -> None:
        self.target = target
        self.path: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._dir: Path | None = None

    async def start(self) -> str:
        """Listen (once); return the socket's path."""
        if self.path is None:
            root = Path(tempfile.gettempdir())
            sweep_dead(root, SOCKET_DIR_PREFIX)
            self._dir = Path(tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-"))
            path = str(self._dir / "controller.sock")
            self._server = await asyncio.start_unix_server(self._serve, path=path)
            self.path = path
            atexit.register(self.close)
        return self.path

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    size = int.from_bytes(await reader.readexactly(_LEN), "little")
                    method, args = pickle.loads(await reader.readexactly(size))
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client closed its connection
                try:
                    if method not in FAST_METHODS:
                        raise TransferError(f"the fast path does not serve {method!r}")
                    reply = ("ok", await getattr(self.target, method)(*args))
                except Exception as exc:  # the caller gets it, as from a Ray call
                    reply = ("err", exc)
                try:
                    data = _frame(reply)
                except Exception as exc:  # an error that does not pickle: keep its message
                    data = _frame(("err", TransferError(f"{type(exc).__name__}: {reply[1]}")))
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def close(self) -> None:
        """Stop listening and remove the socket's directory."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class FastPathClient:
    """Calls a :class:`FastPathServer`: one connection per thread (sync), one per call (async).

    Args:
        path: the server's socket path.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._local = threading.local()

    def _socket(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise FastPathUnavailable(f"no transfer controller at {self.path}: {exc}") from exc
            self._local.sock = sock
        return sock

    def call(self, method: str, *args: Any) -> Any:
        """Call ``method(*args)`` on the server; return its result or raise its error.

        Raises:
            FastPathUnavailable: the server cannot be reached (nothing was sent).
            TransferError: the connection broke during the call (it may have run).
        """
        request = _frame((method, args))
        sock = self._socket()
        try:
            sock.sendall(request)
            size = int.from_bytes(_recv_exactly(sock, _LEN), "little")
            status, value = pickle.loads(_recv_exactly(sock, size))
        except BaseException as exc:
            # A reply may still be on its way: this connection can no longer be trusted.
            self._local.sock = None
            sock.close()
            if isinstance(exc, OSError):
                raise TransferError(
                    f"the transfer controller's fast path broke during {method!r}: {exc}"
                ) from exc
            raise
        if status == "err":
            raise value
        return value

    async def acall(self, method: str, *args: Any) -> Any:
        """Async :meth:`call` (a connection of its own, so concurrent calls do not mix)."""
        try:
            reader, writer = await asyncio.open_unix_connection(self.path)
        except OSError as exc:
            raise FastPathUnavailable(f"no transfer controller at {self.path}: {exc}") from exc
        try:
            writer.write(_frame((method, args)))
            await writer.drain()
            size = int.from_bytes(await reader.readexactly(_LEN), "little")
            status, value = pickle.loads(await reader.readexactly(size))
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise TransferError(
                f"the transfer controller's fast path broke during {method!r}: {exc}"
            ) from exc
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:  # already broken: closed is all that matters
                pass
        if status == "err":
            raise value
        return value

    def close(self) -> None:
        """Close this thread's connection."""
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            self._local.sock = None
            sock.close()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the transfer controller closed the fast-path connection")
        got += k
    return bytes(buf)
