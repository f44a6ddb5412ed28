"""One implementation per client call; its blocking twin runs it on the client's own loop.

A transfer-queue call is written once: its ``async_*`` method awaits the backend's hook, a
coroutine or a blocking method (:func:`serve`), and :func:`on_client_loop` derives the blocking
method from it:

* the blocking method runs the coroutine to completion on an event loop the client owns
  (:class:`ClientLoops`, one per calling thread) and blocks the calling thread meanwhile,
  whatever that thread does. A thread that already runs an event loop (an async Ray actor, a
  trainer's loop) cannot run a second one: the call then runs on one of the client's helper
  threads while the caller waits, blocked, as on any blocking call; its own loop is neither
  used nor needed.
* :func:`waits_in_place` tells a coroutine that it runs for such a blocked caller, on a loop
  that runs nothing else: it may then wait in place (a blocking ``ray.get``, a socket call on
  the thread's own connection) instead of awaiting, which spares the hot paths the loop's
  wake-ups. :func:`offload` runs blocking or CPU-heavy work in place there, and in a worker
  thread when awaited; a blocking hook runs the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Concatenate, ParamSpec, TypeVar

__all__ = ["ClientLoops", "offload", "on_client_loop", "serve", "waits_in_place"]

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")

#: Helper threads of one client: one is busy per thread that runs an event loop and waits in a
#: sync call, so a handful suffices; the bound only keeps a runaway caller from spawning more.
HELPER_THREADS = 32

_IN_PLACE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "polyrl_transfer_in_place", default=False
)


def waits_in_place() -> bool:
    """Whether the running coroutine serves a blocked caller on a loop of its own."""
    return _IN_PLACE.get()


async def offload(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Return ``fn(*args, **kwargs)``: run in place for a blocked caller, else in a thread."""
    if _IN_PLACE.get():
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


async def serve(hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Return the result of a call's hook: a coroutine is awaited, a blocking one offloaded."""
    if inspect.iscoroutinefunction(hook):
        return await hook(*args, **kwargs)
    return await offload(hook, *args, **kwargs)


def on_client_loop(
    method: Callable[Concatenate[S, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[S, P], R]:
    """Return the blocking twin ``<name>`` of the coroutine method ``async_<name>``.

    It runs ``self.async_<name>`` (looked up on the instance, so a subclass's override counts)
    on the loops of the instance's ``_loops`` (a :class:`ClientLoops`) and returns its result.
    It has the method's signature and docstring.
    """
    name = method.__name__
    if not name.startswith("async_"):
        raise ValueError(f"on_client_loop: expected a method named async_*, got {name!r}")
    sync_name = name.removeprefix("async_")

    @functools.wraps(method)
    def twin(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._loops.run(getattr(self, name)(*args, **kwargs))  # type: ignore[attr-defined]

    twin.__name__ = sync_name
    twin.__qualname__ = f"{method.__qualname__.removesuffix(name)}{sync_name}"
    return twin


class _OwnedLoop:
    """One thread's event loop; closed with its holder (the thread ends, or the client goes)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Coroutine[Any, Any, R]) -> R:
        ctx = contextvars.copy_context()
        ctx.run(_IN_PLACE.set, True)
        # The first step is taken eagerly (as Python 3.12's eager tasks take it), with this
        # loop as the running one: a coroutine that serves a blocked caller waits in place, so
        # it mostly ends within that step and costs no turn of the loop (tens of microseconds
        # of polls and callbacks: a third of a whole shared-memory read). What it awaits binds
        # to this loop and carries on there.
        outer = asyncio._get_running_loop()  # None: ClientLoops.run runs no loop's thread here
        asyncio._set_running_loop(self.loop)
        try:
            awaited = ctx.run(coro.send, None)
        except StopIteration as done:
            return done.value
        finally:
            asyncio._set_running_loop(outer)
        return self._carry_on(coro, awaited, ctx)

    def _carry_on(self, coro: Coroutine[Any, Any, R], awaited: Any, ctx: Any) -> R:
        """Run the loop until ``awaited`` is done, then resume ``coro`` in a task to its end."""
        task = None
        try:
            if asyncio.isfuture(awaited):
                awaited._asyncio_future_blocking = False  # taken over, as a task would
                self.loop.run_until_complete(asyncio.wait([awaited]))
            elif awaited is not None:  # a bare yield gives None; anything else is a bug
                raise RuntimeError(f"a coroutine run by ClientLoops yielded {awaited!r}")
            task = self.loop.create_task(coro, context=ctx)
            return self.loop.run_until_complete(task)
        finally:
            if task is None:
                coro.close()
            elif not task.done():  # interrupted (KeyboardInterrupt): end it now, not later
                task.cancel()
                with contextlib.suppress(BaseException):
                    self.loop.run_until_complete(task)

    def close(self) -> None:
        if not self.loop.is_closed():
            self.loop.close()

    def __del__(self) -> None:
        self.close()


class ClientLoops:
    """The event loops on which a client runs its coroutines for blocked (sync) callers.

    Each calling thread gets a loop of its own, created on its first call and closed when the
    thread ends; a thread that already runs an event loop hands its calls to a helper thread
    (see the module docstring). Not picklable: a client unpickled elsewhere makes a new one.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._helpers: ThreadPoolExecutor | None = None

    def run(self, coro: Coroutine[Any, Any, R]) -> R:
        """Run ``coro`` to completion and return its result; the calling thread blocks."""
        if asyncio._get_running_loop() is None:
            return self._run_here(coro)
        return self._helper_threads().submit(self._run_here, coro).result()

    def _run_here(self, coro: Coroutine[Any, Any, R]) -> R:
        owned = getattr(self._local, "loop", None)
        if owned is None:
            owned = self._local.loop = _OwnedLoop()
        return owned.run(coro)

    def _helper_threads(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._helpers is None:
                self._helpers = ThreadPoolExecutor(HELPER_THREADS, "polyrl-transfer-sync")
            return self._helpers

    def close(self) -> None:
        """Close the calling thread's loop and let the helper threads go (later calls reopen)."""
        with self._lock:
            helpers, self._helpers = self._helpers, None
        if helpers is not None:
            helpers.shutdown(wait=False)
        owned = getattr(self._local, "loop", None)
        if owned is not None:
            self._local.loop = None
            owned.close()
