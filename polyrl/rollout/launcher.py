"""Replica subprocesses and the ``polyrl serve`` command.

:class:`ServerProcess` runs ``python -m polyrl.workers.rollout_server`` (the rollout server with
the weight-transfer routes; see :data:`SERVER_MODULE`) as a child process on a port the child
picks itself (no race for a "free" port) and waits until it accepts requests.
:func:`serve_command` runs one replica in-process, or several replica processes behind a router
on the requested port; ``polyrl serve`` runs it through
:func:`polyrl.workers.rollout_server.serve_command`, which adds the weight routes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyrl.core.cpu import cores_per_process
from polyrl.rollout.options import API_KEY_ENV, PARENT_FD_ENV, ServerLimits

if TYPE_CHECKING:
    from polyrl.rollout.server import AppExtension

__all__ = ["SERVER_MODULE", "ServerProcess", "serve_command", "start_processes", "start_replicas"]

#: The module a replica process runs (``python -m``): the rollout server composed with the
#: routes of the services around it (weight transfer), which the rollout service cannot import.
SERVER_MODULE = "polyrl.workers.rollout_server"


class ServerProcess:
    """One rollout server replica in a child process.

    Args:
        model_dir: local HF model directory.
        backend: registered backend name.
        host: address the replica binds.
        port: port (0: the child picks a free one).
        api_key: bearer token the replica requires (passed through the environment).
        options: backend options (fields of the backend's ``options_class``).
        log_path: where the child's stdout/stderr go (default: a file in the replica's
            temporary directory, which :meth:`stop` and :meth:`kill` remove; a log at a
            ``log_path`` of the caller's is kept).
        env: extra environment variables for the child.
        module: the module the child runs with ``python -m``; it takes the flags of
            :func:`polyrl.rollout.server.build_parser`.
        limits: the request limits of the child (default: its defaults).
    """

    _SAVED_TAIL_CHARS = 16_000

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        backend: str = "native",
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        options: Mapping[str, Any] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        module: str = SERVER_MODULE,
        limits: ServerLimits | None = None,
    ):
        self.model_dir = str(model_dir)
        self.limits = limits
        self.backend = backend
        self.host = host
        self.port = port
        self.api_key = api_key
        self.options = dict(options or {})
        self.env = dict(env or {})
        self.module = module
        self._tmp = tempfile.mkdtemp(prefix="polyrl-replica-")
        self.log_path = Path(log_path) if log_path else Path(self._tmp) / "server.log"
        self.ready_file = Path(self._tmp) / "ready.json"
        # Also removed if this object is collected or the interpreter exits without a stop().
        self._remove_tmp = weakref.finalize(self, shutil.rmtree, self._tmp, ignore_errors=True)
        self._saved_tail = ""
        self.process: subprocess.Popen[bytes] | None = None
        self.url: str | None = None
        # Write end of the child's lifeline pipe: never written, closed by the kernel when this
        # process dies however it dies, which the child sees as end-of-file and shuts down.
        self._lifeline: int | None = None
        # The port a restart binds again (see restart()); None: ``port``.
        self._bind_port: int | None = None

    @property
    def command(self) -> list[str]:
        """The child's command line."""
        return [
            sys.executable,
            "-m",
            self.module,
            self.model_dir,
            "--host",
            self.host,
            "--port",
            str(self.port if self._bind_port is None else self._bind_port),
            "--backend",
            self.backend,
            "--ready-file",
            str(self.ready_file),
            *self._option_args(),
        ]

    def _option_args(self) -> list[str]:
        # The backend options travel as one JSON object of option names: the launcher knows
        # no option by name, so a new backend option needs no flag here.
        options = {k: v for k, v in self.options.items() if v is not None}
        args = ["--engine-options", json.dumps(options)] if options else []
        return args + (self.limits.to_args() if self.limits is not None else [])

    def spawn(self) -> ServerProcess:
        """Start the child without waiting for it (see :meth:`wait_ready`)."""
        if self.process is not None:
            raise RuntimeError("this replica was already started")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        env.pop(API_KEY_ENV, None)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        read_end, self._lifeline = os.pipe()  # both close-on-exec; the child gets read_end only
        env[PARENT_FD_ENV] = str(read_end)
        try:
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    self.command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    pass_fds=(read_end,),
                )
        except BaseException:
            os.close(self._lifeline)
            self._lifeline = None
            raise
        finally:
            os.close(read_end)
        return self

    def log_tail(self, chars: int = 4000) -> str:
        """Return the end of the child's log (kept in memory once the log file is removed)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return self._saved_tail[-chars:]

    def wait_ready(self, timeout: float = 300.0) -> str:
        """Wait until the child accepts requests; return its URL.

        Raises:
            RuntimeError: the child exited first (its log tail is in the message).
            TimeoutError: it did not get ready in time.
        """
        if self.process is None:
            raise RuntimeError("spawn() the replica first")
        deadline = time.monotonic() + timeout
        while True:
            if self.ready_file.exists():
                info = json.loads(self.ready_file.read_text())
                self.url = str(info["url"])
                return self.url
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"rollout server exited with code {code} before getting ready; log tail:\n"
                    f"{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise TimeoutError(f"rollout server not ready after {timeout} s; log tail:\n{tail}")
            time.sleep(0.05)

    def start(self, timeout: float = 300.0) -> ServerProcess:
        """Spawn the child and wait until it accepts requests."""
        self.spawn()
        self.wait_ready(timeout)
        return self

    def restart(self, timeout: float = 300.0) -> str:
        """Start the replica again, with the same command and environment; return its URL.

        A child still running is killed first. The new child binds the port of the old one
        when it can, so the URL stays; when that port is taken meanwhile it binds ``port``
        (0: a new free one). The log goes on in the same file after a line that marks the
        restart.

        Raises:
            RuntimeError: the new child exited before getting ready (log tail in the message).
            TimeoutError: it did not get ready in ``timeout`` seconds.
        """
        from urllib.parse import urlsplit

        if self.process is not None and self.process.poll() is None:
            self.process.kill()  # not kill(): the log and the temporary directory stay
            self.process.wait()
        self._close_lifeline()
        if not self._remove_tmp.alive:  # stopped before: a new temporary directory
            Path(self._tmp).mkdir(parents=True, exist_ok=True)
            self._remove_tmp = weakref.finalize(self, shutil.rmtree, self._tmp, ignore_errors=True)
        previous = None if self.process is None else self.process.returncode
        old_port = urlsplit(self.url).port if self.url else None
        deadline = time.monotonic() + timeout
        for port in dict.fromkeys([old_port, None]):  # the old port first, then ``port``
            self.process = None
            self.url = None
            self._close_lifeline()
            self.ready_file.unlink(missing_ok=True)
            self._bind_port = port
            with open(self.log_path, "ab") as log:
                log.write(
                    f"\n[polyrl] restarting the replica on port {port or self.port} (it exited "
                    f"with {previous})\n".encode()
                )
            self.spawn()
            try:
                return self.wait_ready(max(deadline - time.monotonic(), 1.0))
            except RuntimeError:
                if port is None:
                    raise
                previous = None if self.process is None else self.process.returncode
        raise AssertionError("unreachable")

    @property
    def alive(self) -> bool:
        """Whether the child process is running."""
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 15.0) -> int | None:
        """Ask the child to shut down (SIGTERM), kill it if it lingers; return its exit code.

        The replica's temporary directory goes too (with the log, unless ``log_path`` was
        given); :meth:`log_tail` still returns the end of the log.
        """
        if self.process is None:
            self._remove_tmp()
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close()
        return self.process.returncode

    def _close_lifeline(self) -> None:
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    def _close(self) -> None:
        self._close_lifeline()
        if self._remove_tmp.alive:
            self._saved_tail = self.log_tail(self._SAVED_TAIL_CHARS)
            self._remove_tmp()

    def kill(self) -> None:
        """Kill the child at once (SIGKILL), as a crash would; remove its temporary directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._close()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_replicas(
    model_dir: str | os.PathLike[str],
    count: int,
    *,
    timeout: float = 300.0,
    **kwargs: Any,
) -> list[ServerProcess]:
    """Start ``count`` replicas in parallel and wait for all of them.

    Keyword arguments go to :class:`ServerProcess`. On failure every started child is stopped.
    """
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"replica count must be an int >= 1, got {count!r}")
    return start_processes([ServerProcess(model_dir, **kwargs) for _ in range(count)], timeout)


def start_processes(
    replicas: Sequence[ServerProcess], timeout: float = 300.0
) -> list[ServerProcess]:
    """Spawn every replica, then wait for all of them; on failure every one is stopped."""
    try:
        for r in replicas:
            r.spawn()
        for r in replicas:
            r.wait_ready(timeout)
    except BaseException:
        for r in replicas:
            r.stop()
        raise
    return list(replicas)


def serve_command(
    model_dir: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    replicas: int = 1,
    backend: str = "native",
    api_key: str | None = None,
    ready_file: str | None = None,
    log_level: str = "warning",
    options: Mapping[str, Any] | None = None,
    extensions: Sequence[AppExtension] = (),
    limits: ServerLimits | None = None,
    insecure: bool = False,
) -> int:
    """Run ``polyrl serve``: one replica here, or ``replicas`` children behind a router.

    ``extensions`` go to :func:`~polyrl.rollout.server.create_app` of the replica served here;
    children run :data:`SERVER_MODULE`. Once requests are accepted it prints one line,
    ``serving MODEL_DIR at URL``, on stderr. Returns the exit code once interrupted.

    Raises:
        ValueError: ``host`` is beyond loopback with no ``api_key`` and not ``insecure``.
    """
    from polyrl.core.http import serve_app
    from polyrl.rollout.server import check_exposure, serve

    opts = dict(options or {})

    def announce(url: str) -> None:
        print(f"serving {model_dir} at {url}", file=sys.stderr, flush=True)

    if replicas == 1:
        serve(
            model_dir,
            host=host,
            port=port,
            backend=backend,
            api_key=api_key,
            ready_file=ready_file,
            log_level=log_level,
            extensions=extensions,
            limits=limits,
            insecure=insecure,
            on_ready=announce,
            **opts,
        )
        return 0
    check_exposure(host, api_key, insecure)  # before any replica starts
    if backend == "native" and "num_threads" not in opts:
        # Replicas share the machine's cores instead of each claiming all of them.
        opts["num_threads"] = cores_per_process(replicas)
    children = start_replicas(
        model_dir, replicas, backend=backend, api_key=api_key, options=opts, limits=limits
    )
    try:
        from polyrl.rollout.client import RolloutClient
        from polyrl.rollout.router import create_router_app

        urls = [c.url for c in children if c.url]
        client = RolloutClient(urls, api_key=api_key)
        app = create_router_app(client, api_key=api_key, limits=limits)
        asyncio.run(serve_app(app, host, port, ready_file, log_level, announce))
    except KeyboardInterrupt:
        return 130
    finally:
        for child in children:
            child.stop()
    return 0
