"""The ``local`` backend: the same semantics as ``ray`` without a cluster.

Two modes, chosen by ``local_mode``:

``"inline"`` (default for a world of one)
    The rank lives in the driver process and every call runs synchronously in the calling
    thread -- put a breakpoint in a worker method and step through it. ``torch.distributed`` is
    initialised as a one-rank gloo group (or an existing one-rank group is reused).

``"process"`` (default for a world of two or more)
    Each rank is a subprocess (forked from a fork server for CPU ranks, ``spawn``-ed for GPU
    ones; see :func:`_rank_context`), so ranks have separate ``torch.distributed`` states
    and real gloo collectives run between them (threads cannot do this: the default process
    group is per process). Arguments and results travel pickled over a pipe per rank; worker
    classes and their arguments must therefore be picklable by reference (module-level classes).
    A reader thread per rank turns a closed pipe into
    :class:`~polyrl.controller.errors.WorkerDiedError` for every pending call, health checks are
    answered by a separate thread in the subprocess, and a subprocess exits by itself when the
    driver goes away.

Handles are :class:`concurrent.futures.Future` objects. Unlike Ray, results do pass through the
driver process (futures are resolved there before the next call is sent), which keeps results
identical but not the transfer pattern; use the ``ray`` backend to measure data movement.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from polyrl.controller.backend import Backend
from polyrl.controller.errors import (
    ControllerError,
    DispatchError,
    WorkerDiedError,
    WorkerError,
)
from polyrl.controller.resource_pool import ResourcePool
from polyrl.controller.worker import (
    HostSetup,
    WorkerHost,
    WorkerInfo,
    WorkerSpec,
    _format_error,
    driver_import_path,
)
from polyrl.core.plugins import plugin_modules

__all__ = ["LocalBackend"]

_LOCAL_MODES = ("auto", "inline", "process")

#: What the fork server that CPU ranks start from imports once (see :func:`_rank_context`).
_FORKSERVER_PRELOAD = (
    "torch",
    "tensordict",
    "transformers.modeling_utils",
    "polyrl.controller.local_backend",
)


def _rank_context(use_gpu: bool) -> Any:
    """Return the ``multiprocessing`` context the rank subprocesses start with.

    A spawned rank imports torch and (for an engine) transformers' model code afresh: ~3.5 s of
    CPU before it does anything. CPU ranks fork instead from a fork server (one per driver
    process, started on first use) that imported those once, as torch's own data loaders fork
    after importing torch; each rank gets the driver's current environment back on start
    (:func:`_rank_main`), not the one the server started with. GPU ranks keep ``spawn``: a fork
    server is not tried on GPUs here, and there model loading dominates the start anyway.
    """
    if use_gpu or sys.platform != "linux":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Only read when the server starts; a server already running (started by this or other
    # code) is used as it is, which is as correct, only slower.
    ctx.set_forkserver_preload(list(_FORKSERVER_PRELOAD))
    return ctx


def _done(value: Any = None, error: BaseException | None = None) -> cf.Future:
    fut: cf.Future = cf.Future()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
    return fut


def _resolve(value: Any) -> Any:
    return value.result() if isinstance(value, cf.Future) else value


def _resolve_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    return tuple(_resolve(a) for a in args), {k: _resolve(v) for k, v in kwargs.items()}


# ----------------------------------------------------------------------------------------------
# Subprocess side
# ----------------------------------------------------------------------------------------------
def _rank_main(conn: Any, setup_bytes: bytes, environ: dict[str, str]) -> None:
    """Entry point of a rank subprocess: serve calls from the driver until told to exit.

    ``environ`` is the driver's environment when the rank was created: a rank forked from the
    fork server would otherwise have the server's (see :func:`_rank_context`).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    os.environ.clear()
    os.environ.update(environ)
    send_lock = threading.Lock()
    calls: queue.Queue = queue.Queue()

    def send(msg: tuple[Any, ...]) -> None:
        try:
            data = pickle.dumps(msg, protocol=5)
        except Exception as exc:  # noqa: BLE001 - report unpicklable results as call errors
            err = WorkerError(
                rank,
                str(msg[3]) if len(msg) > 3 else "?",
                type(exc).__qualname__,
                f"result cannot be pickled back to the driver: {exc}",
                "",
                os.getpid(),
                "local",
            )
            data = pickle.dumps(("err", msg[1], err, ""), protocol=5)
        with send_lock:
            conn.send_bytes(data)

    def reader() -> None:
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                os._exit(0)  # the driver is gone: leave no stray process behind
            if msg[0] == "ping":
                send(("pong", msg[1], os.getpid(), ""))
            elif msg[0] == "exit":
                calls.put(None)
                return
            else:
                calls.put(msg)

    rank = -1
    host: WorkerHost | None = None
    startup_error: BaseException | None = None
    try:
        setup: HostSetup = pickle.loads(setup_bytes)
        rank = setup.rank
        host = WorkerHost(setup)
    except BaseException as exc:  # noqa: BLE001 - reported on the first call
        startup_error = _format_error(exc, rank, "<start>", os.getpid(), "local")
    threading.Thread(target=reader, name="polyrl-rank-reader", daemon=True).start()
    while True:
        msg = calls.get()
        if msg is None:
            break
        _, call_id, name, args, kwargs, label = msg
        if startup_error is not None or host is None:
            send(("err", call_id, startup_error, label))
            continue
        try:
            send(("ok", call_id, getattr(host, name)(*args, **kwargs), label))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver
            send(("err", call_id, _format_error(exc, rank, label, os.getpid(), "local"), label))
    if host is not None:
        host.teardown()
    conn.close()
    # Skip interpreter finalisation: threads started by user libraries (non-daemon pools,
    # atexit joins) must not keep a rank alive after the driver asked it to go.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------------------------
# Driver side
# ----------------------------------------------------------------------------------------------
class _RankProcess:
    """Driver-side end of one rank subprocess: ordered sender, reader, pending-call table."""

    _ids = itertools.count()

    def __init__(self, ctx: Any, setup: HostSetup) -> None:
        self.rank = setup.rank
        parent, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_rank_main,
            args=(child, pickle.dumps(setup, protocol=5), dict(os.environ)),
            name=f"polyrl-{setup.group_name}-rank{setup.rank}",
            daemon=False,  # a rank may start its own subprocesses (data loaders, servers)
        )
        self.proc.start()
        child.close()
        self.conn = parent
        self._send_lock = threading.Lock()
        self._table_lock = threading.Lock()
        self._pending: dict[int, tuple[cf.Future, str | None]] = {}
        self.dead_reason: str | None = None
        self._queue: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, daemon=True)
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._sender.start()
        self._reader.start()

    # -- sending ----------------------------------------------------------------------------
    def submit(
        self,
        name: str,
        args: tuple,
        label: str,
        user_call: tuple[tuple, dict] | None = None,
    ) -> cf.Future:
        """Queue a host call; ``user_call`` arguments (resolved first) are appended to ``args``."""
        fut: cf.Future = cf.Future()
        self._queue.put((next(self._ids), name, args, user_call, label, fut))
        return fut

    def _send_loop(self) -> None:
        # One thread per rank keeps calls in submission order even when an argument is a
        # future that is not done yet (the call waits here, the driver does not block).
        while True:
            item = self._queue.get()
            if item is None:
                return
            call_id, name, args, user_call, label, fut = item
            if user_call is not None:
                try:
                    args = (*args, *_resolve_args(*user_call))
                except BaseException as exc:  # noqa: BLE001 - an upstream failure fails this call
                    fut.set_exception(exc)
                    continue
            try:
                payload = pickle.dumps(("call", call_id, name, args, {}, label), protocol=5)
            except Exception as exc:  # noqa: BLE001
                fut.set_exception(
                    DispatchError(
                        f"{label}: arguments cannot be pickled for rank {self.rank}: {exc}"
                    )
                )
                continue
            if not self._register(call_id, fut, label):
                continue
            self._send(payload)

    def _register(self, call_id: int, fut: cf.Future, label: str | None) -> bool:
        with self._table_lock:
            if self.dead_reason is not None:
                fut.set_exception(WorkerDiedError(self.rank, label, self.dead_reason))
                return False
            self._pending[call_id] = (fut, label)
            return True

    def _send(self, payload: bytes) -> None:
        try:
            with self._send_lock:
                self.conn.send_bytes(payload)
        except (OSError, ValueError):
            self._mark_dead()

    def ping(self) -> cf.Future:
        fut: cf.Future = cf.Future()
        call_id = next(self._ids)
        if self._register(call_id, fut, None):
            self._send(pickle.dumps(("ping", call_id)))
        return fut

    # -- receiving ---------------------------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                self._mark_dead()
                return
            try:
                kind, call_id, payload, _ = pickle.loads(data)
            except Exception as exc:  # noqa: BLE001 - e.g. a result class unknown to the driver
                kind, call_id, payload = "bad", None, exc
            with self._table_lock:
                entry = self._pending.pop(call_id, None) if call_id is not None else None
            if entry is None:
                continue
            fut, _label = entry
            if kind in ("ok", "pong"):
                fut.set_result(payload)
            elif kind == "err":
                fut.set_exception(payload)
            else:
                fut.set_exception(
                    ControllerError(f"cannot read a reply from rank {self.rank}: {payload}")
                )

    def _mark_dead(self) -> None:
        self.proc.join(timeout=0.5)
        code = self.proc.exitcode
        if code is None:
            reason = f"pipe to process {self.proc.pid} closed"
        elif code < 0:
            reason = f"process {self.proc.pid} was killed by signal {-code}"
        else:
            reason = f"process {self.proc.pid} exited with code {code}"
        with self._table_lock:
            if self.dead_reason is None:
                self.dead_reason = reason
            pending, self._pending = self._pending, {}
        for fut, label in pending.values():
            if not fut.done():
                fut.set_exception(WorkerDiedError(self.rank, label, reason))

    def request_exit(self) -> None:
        """Ask the subprocess to finish its current call, tear down and exit."""
        self._queue.put(None)
        try:
            with self._send_lock:
                self.conn.send_bytes(pickle.dumps(("exit",)))
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


def _stop_all(ranks: list[_RankProcess], grace_s: float = 2.0) -> None:
    """Exit request, then SIGTERM, then SIGKILL (which also ends a SIGSTOP-ed process).

    Ranks are stopped together so a group of hung ranks costs one grace period, not one each.
    """
    for r in ranks:
        r.request_exit()
    for limit, escalate in ((grace_s, "terminate"), (1.0, "kill"), (5.0, None)):
        deadline = time.monotonic() + limit
        for r in ranks:
            r.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [r for r in ranks if r.proc.is_alive()]
        if not alive or escalate is None:
            break
        for r in alive:
            getattr(r.proc, escalate)()
    for r in ranks:
        r.close()


class LocalBackend(Backend):
    """Ranks inline in the driver (world of one) or as subprocesses (see :func:`_rank_context`)."""

    kind = "local"

    def __init__(self, group_name: str, *, local_mode: str = "auto", **kwargs: Any) -> None:
        super().__init__(group_name, **kwargs)
        if local_mode not in _LOCAL_MODES:
            raise ValueError(f"local_mode must be one of {_LOCAL_MODES}, got {local_mode!r}")
        self.local_mode = local_mode
        self.mode = local_mode
        self._inline: WorkerHost | None = None
        self._ranks: list[_RankProcess] = []
        self._executor: cf.ThreadPoolExecutor | None = None

    def start(
        self,
        roles: dict[str, WorkerSpec],
        pool: ResourcePool,
        *,
        init_distributed: bool,
        dist_timeout_s: float,
        start_timeout_s: float,
    ) -> list[WorkerInfo]:
        """Create the ranks (inline or subprocesses) and build the roles."""
        world = pool.world_size
        mode = self.local_mode
        if mode == "auto":
            mode = "inline" if world == 1 else "process"
        if mode == "inline" and world != 1:
            raise ValueError(
                f"local_mode='inline' runs a single rank in the driver; world_size is {world}. "
                "Use local_mode='process' for several ranks"
            )
        self.mode = mode
        self._executor = cf.ThreadPoolExecutor(2, thread_name_prefix=f"polyrl-{self.group_name}")
        # Same format as the ray backend: classes defined in a script's __main__ travel by value.
        # Ray's vendored copy when Ray is installed, else the standalone package: the local
        # backend must run where Ray is not (e.g. a GPU box with only the local path's wheels).
        try:
            from ray import cloudpickle
        except ImportError:
            import cloudpickle

        roles_blob = cloudpickle.dumps(roles)
        sys_path = driver_import_path()
        setups = [
            HostSetup(
                group_name=self.group_name,
                rank=rank,
                world_size=world,
                local_rank=rank,
                local_world_size=world,
                roles_blob=roles_blob,
                sys_path=sys_path,
                init_distributed=init_distributed,
                dist_timeout_s=dist_timeout_s,
                use_gpu=pool.pins_gpu,
                backend_kind="inline" if mode == "inline" else "local",
                plugins=plugin_modules(),
            )
            for rank in range(world)
        ]
        try:
            if mode == "inline":
                host = WorkerHost(setups[0])
                self._inline = host
                backend = host.init_distributed_inline() if init_distributed else None
                host.construct()
                self.infos = [_with_backend(host.info(), backend)]
                self.alive = True
                return self.infos
            ctx = _rank_context(pool.pins_gpu)
            self._ranks = [_RankProcess(ctx, s) for s in setups]
            self.alive = True
            deadline = time.monotonic() + start_timeout_s
            self.infos = self._get_all("info", [()] * world, deadline)
            if init_distributed:
                addr, port = self._get_all("rendezvous", [()], deadline, ranks=[0])[0]
                backends = self._get_all(
                    "init_distributed", [(addr, port)] * world, time.monotonic() + dist_timeout_s
                )
                self.infos = [
                    _with_backend(i, b) for i, b in zip(self.infos, backends, strict=True)
                ]
            self._get_all("construct", [()] * world, None)
        except BaseException:
            self.shutdown()
            raise
        return self.infos

    def _get_all(
        self, name: str, args: list[tuple], deadline: float | None, ranks: list[int] | None = None
    ) -> list[Any]:
        from polyrl.controller.futures import Watch, await_handles

        ranks = list(range(len(self._ranks))) if ranks is None else ranks
        watches = [
            Watch(self, r, f"<{name}>", self._ranks[r].submit(name, a, f"<{name}>"))
            for r, a in zip(ranks, args, strict=True)
        ]
        timeout = None if deadline is None else max(0.1, deadline - time.monotonic())
        try:
            # A rank still starting (importing, placing) cannot answer pings yet.
            return await_handles(watches, timeout, health=name != "info")
        except TimeoutError as exc:
            raise ControllerError(
                f"group {self.group_name!r}: <{name}> did not finish within the start-up timeout"
            ) from exc

    # ------------------------------------------------------------------------------- calls
    def submit(self, rank, role, method, label, discard, args, kwargs):  # noqa: D102
        if not self.alive:
            return _done(error=ControllerError(f"group {self.group_name!r} is shut down"))
        if self._inline is not None:
            try:
                args, kwargs = _resolve_args(args, kwargs)
                return _done(self._inline.execute(role, method, label, discard, args, kwargs))
            except BaseException as exc:  # noqa: BLE001 - surfaced by the future
                return _done(error=exc)
        return self._ranks[rank].submit(
            "execute", (role, method, label, discard), label, (args, kwargs)
        )

    def host_call(self, rank: int, name: str, *args: Any) -> Any:  # noqa: D102
        if self._inline is not None:
            try:
                return _done(getattr(self._inline, name)(*args))
            except BaseException as exc:  # noqa: BLE001
                return _done(error=exc)
        return self._ranks[rank].submit(name, args, f"<{name}>")

    def put(self, value: Any) -> Any:  # noqa: D102
        return value

    def apply(self, fn, inputs, num_returns):  # noqa: D102
        assert self._executor is not None

        def run() -> Any:
            return fn(*[_resolve(x) for x in inputs])

        whole = self._executor.submit(run)
        if num_returns == 1:
            return [whole]
        parts: list[cf.Future] = [cf.Future() for _ in range(num_returns)]

        def fan_out(done: cf.Future) -> None:
            exc = done.exception()
            if exc is not None:
                for p in parts:
                    p.set_exception(exc)
                return
            values = list(done.result())
            if len(values) != num_returns:
                err = DispatchError(
                    f"remote op returned {len(values)} values, expected {num_returns}"
                )
                for p in parts:
                    p.set_exception(err)
                return
            for p, v in zip(parts, values, strict=True):
                p.set_result(v)

        whole.add_done_callback(fan_out)
        return parts

    def is_handle(self, value: Any) -> bool:  # noqa: D102
        return isinstance(value, cf.Future)

    def wait(self, handles: Sequence[Any], timeout: float) -> list[int]:  # noqa: D102
        if not handles:
            return []
        done, _ = cf.wait(list(handles), timeout=timeout, return_when=cf.FIRST_COMPLETED)
        return [i for i, h in enumerate(handles) if h in done]

    def fetch(self, handle: Any, rank: int | None, label: str) -> Any:  # noqa: D102
        return handle.result()

    def ping(self, rank: int) -> Any:  # noqa: D102
        if self._inline is not None:
            return _done(os.getpid())
        return self._ranks[rank].ping()

    def check_ping(self, handle: Any, rank: int, label: str | None) -> None:  # noqa: D102
        exc = handle.exception(timeout=0)
        if isinstance(exc, WorkerDiedError):
            raise WorkerDiedError(rank, label, exc.reason)
        if exc is not None:
            raise exc

    def pids(self) -> list[int]:  # noqa: D102
        return [info.pid for info in self.infos]

    def shutdown(self) -> None:
        """Stop subprocesses (exit, then SIGTERM, then SIGKILL) or tear down the inline rank."""
        self.alive = False
        if self._inline is not None:
            self._inline.teardown()
            self._inline = None
        ranks, self._ranks = self._ranks, []
        _stop_all(ranks)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _with_backend(info: WorkerInfo, backend: str | None) -> WorkerInfo:
    from dataclasses import replace

    return replace(info, dist_backend=backend)
