"""Serving an ASGI app on a socket of our own: what every polyrl HTTP process shares.

:func:`serve_app` runs uvicorn on a socket bound here (``TCP_NODELAY`` set, port 0 for "any"),
writes a ready file once requests are accepted and shuts down gracefully on SIGINT/SIGTERM. The
rollout server, its router and the agent proxy all serve through it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["serve_app"]


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on sockets whose proto says TCP
    # (proto 0 does not), and without it Nagle + delayed ACKs add ~40 ms to every response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


async def serve_app(
    app: Any,
    host: str,
    port: int,
    ready_file: str | None,
    log_level: str,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve ``app`` with uvicorn on ``host:port`` until SIGINT/SIGTERM.

    Args:
        app: the ASGI app.
        host: address to bind.
        port: port (0 picks a free one).
        ready_file: where to write ``{"url", "pid"}`` once requests are accepted.
        log_level: uvicorn log level.
        on_ready: called with the URL once requests are accepted.
    """
    import uvicorn

    sock = _bind(host, port)
    url = _url(host, sock.getsockname()[1])
    config = uvicorn.Config(
        app, log_level=log_level, access_log=False, timeout_keep_alive=30, lifespan="on"
    )
    server = uvicorn.Server(config)

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        # What exists now (torch, the model, the app) lives as long as the process. Frozen, it
        # leaves the collector's generations, so a full collection while serving stays cheap;
        # unfrozen, one walks every object of torch and transformers (hundreds of ms on this
        # server, with the GIL held, so the engine thread stalls too).
        gc.collect()
        gc.freeze()
        if ready_file:
            tmp = Path(ready_file).with_suffix(".tmp")
            tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
            os.replace(tmp, ready_file)
        if on_ready is not None:
            on_ready(url)

    if threading.current_thread() is threading.main_thread():
        # uvicorn shuts down gracefully on SIGTERM and then re-raises the signal to the
        # handler that was installed before it; a no-op one lets the process exit with 0.
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    watcher = asyncio.ensure_future(announce())
    try:
        await server.serve(sockets=[sock])
    finally:
        watcher.cancel()
        sock.close()
