"""The asynchronous modes' rollout producer in a process of its own (``async.producer=process``).

In ``trainer.mode=one_step_off|async`` a rollout thread generates prompt groups ahead of
training (:class:`~polyrl.trainer.rl.asynchronous.AheadRollout`). With ``async.producer=thread``
its producer -- the HTTP client, the agent loops, tokenization and reward scoring -- shares the
trainer's process, so its CPU time and the GIL are taken from the engines' Python threads. With
``process`` the producer runs in a spawned child: the rollout thread keeps what decides what is
trained (the sampler, the staleness gate, the replay buffer, checkpoints) and sends each group
it starts (its prompt row, ``n``, temperature and seed) down a pipe; the child generates and
scores the groups concurrently on its own event loop and streams each one back, scored, as
soon as it is done, and the rollout thread fills its buffer entry. A group is generated and
scored by the same :meth:`~polyrl.trainer.rl.rollout.RolloutProducer.produce_group` in both
cases, so the same seed gives the same samples.

The child also answers the calls the trainer makes of a producer's client (a replica restarted:
out of rotation, back in; the wait for a replica; aborts; the retry count): see
:class:`ProducerProcess`. It exits when the pipe closes (the trainer is gone), closing its
reward workers first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import itertools
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from polyrl.config import ConfigError, PolyRLConfig

__all__ = ["ProducerProcess"]

#: Seconds a control call (routing, flags, counters) may take before it counts as lost.
_CALL_TIMEOUT_S = 60.0
#: What a request sent after close() fails with.
_STOPPED = "the rollout producer process was stopped"


def _reply_error(exc: BaseException) -> str:
    """Format a failure in the child as the trainer reports it."""
    return "".join(traceback.format_exception(exc)).rstrip()


def _portable(exc: BaseException) -> bytes | None:
    """Pickle ``exc`` when it survives the round trip, so the trainer raises the same type.

    The trainer's recovery and its one-line stop messages (a dead reward worker, a lost replica)
    dispatch on the exception's type; ``None`` for one that does not unpickle as itself.
    """
    try:
        blob = pickle.dumps(exc, protocol=5)
        back = pickle.loads(blob)
    except Exception:  # noqa: BLE001 - an unpicklable exception falls back to its text
        return None
    return blob if type(back) is type(exc) and str(back) == str(exc) else None


def _child_error(payload: tuple[str, bytes | None]) -> BaseException:
    """Rebuild a failure of the child on the trainer's side: its own type where it pickled."""
    text, blob = payload
    if blob is not None:
        exc = pickle.loads(blob)
        exc.add_note(f"in the rollout producer process:\n{text}")
        return exc
    return RuntimeError(f"in the rollout producer process: {text}")


class _Child:
    """The child's side: a :class:`RolloutProducer` serving the rollout thread's requests."""

    def __init__(self, conn: Any, setup: Mapping[str, Any]) -> None:
        from polyrl.core.plugins import import_plugins
        from polyrl.models.loader import load_tokenizer
        from polyrl.trainer.rl.build import vision_processor
        from polyrl.trainer.rl.rollout import RolloutProducer, reward_manager

        cfg: PolyRLConfig = setup["cfg"]
        import_plugins(cfg.trainer.imports)  # the user's agent loops, environments, tools
        self.conn = conn
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        tokenizer = load_tokenizer(
            setup["model_dir"], trust_remote_code=cfg.model.trust_remote_code
        )
        producer = RolloutProducer(
            cfg,
            _new_client(setup["urls"], setup["api_key"]),
            tokenizer,
            reward_manager(cfg, setup["reward_fn"]),
            self.loop,
        )
        self.producer = producer
        producer.processor = vision_processor(cfg, setup["model_dir"], tokenizer)
        self.loop.run_until_complete(producer.client.start())
        self._send_lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._exit = asyncio.Event()

    def send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=5)
        with self._send_lock:
            self.conn.send_bytes(data)

    def serve(self) -> None:
        """Answer requests until the trainer says ``exit`` or goes away."""
        threading.Thread(target=self._read, name="polyrl-producer-reader", daemon=True).start()
        try:
            self.loop.run_until_complete(self._exit.wait())
            for task in self._tasks:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*self._tasks, return_exceptions=True))
        finally:
            self.producer.close()

    def _read(self) -> None:
        while True:
            try:
                message = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                message = ("exit",)  # the trainer is gone
            if message[0] == "exit":
                self.loop.call_soon_threadsafe(self._exit.set)
                return
            self.loop.call_soon_threadsafe(self._start, message)

    def _start(self, message: tuple[Any, ...]) -> None:
        task = self.loop.create_task(self._answer(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, message: tuple[Any, ...]) -> None:
        kind, call_id, *args = message
        try:
            if kind == "group":
                result = await self.producer.produce_group(*args)
            else:
                result = await self._control(*args)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the trainer
            self.send(("err", call_id, (_reply_error(exc), _portable(exc))))
            return
        self.send(("ok", call_id, result))

    async def _control(self, name: str, *args: Any) -> Any:
        """Make a client call or set or read a flag (see :class:`ProducerProcess`)."""
        producer, client = self.producer, self.producer.client
        if name == "abort":
            return await client.abort()
        if name == "replace_replica":
            old, new, enabled = args
            return client.replace_replica(old, new, enabled=enabled)
        if name == "enable_replica":
            url, enabled = args
            return client.enable_replica(url, enabled=enabled)
        if name in ("replica_wait", "resume_aborted", "stopping"):
            target = client if name == "replica_wait" else producer
            setattr(target, name, args[0])
            return None
        if name == "counters":
            return {"retries": client.retries, "resumed_samples": producer.resumed_samples}
        raise ValueError(f"unknown producer call {name!r}")


def _new_client(urls: Sequence[str], api_key: str | None) -> Any:
    from polyrl.rollout.client import RolloutClient

    # As RolloutProducer.connect builds the driver's and the rollout thread's.
    return RolloutClient(list(urls), api_key=api_key, max_concurrency=512)


def _child_main(conn: Any, setup_bytes: bytes) -> None:
    """Entry point of the producer process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    try:
        child = _Child(conn, pickle.loads(setup_bytes))
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer, which raises it
        conn.send_bytes(pickle.dumps(("failed", None, _reply_error(exc)), protocol=5))
        conn.close()
        os._exit(1)
    child.send(("ready", None, child.producer.pad_id))
    child.serve()
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalisation: a library's non-daemon thread must not keep it alive.
    os._exit(0)


class _ProcessClient:
    """The producer process's rollout client as the trainer's replicas drive it.

    :class:`~polyrl.trainer.rl.generation.Replicas` routes every producer's client when a
    replica is restarted (see :meth:`~polyrl.trainer.rl.generation.Replicas.attach`); the
    rollout thread aborts its requests when the run ends.
    """

    def __init__(self, owner: ProducerProcess) -> None:
        self._owner = owner
        self._replica_wait = 0.0

    def replace_replica(self, old_url: str, new_url: str, *, enabled: bool = True) -> None:
        """Put ``new_url`` in the place of ``old_url`` in the child's client."""
        self._owner.call("replace_replica", old_url, new_url, enabled)

    def enable_replica(self, url: str, enabled: bool = True) -> None:
        """Let ``url`` take the child's requests (``enabled=False``: hold it out)."""
        try:
            self._owner.call("enable_replica", url, enabled)
        except RuntimeError as exc:
            if "KeyError" in str(exc):  # as the client itself raises for an unknown URL
                raise KeyError(url) from exc
            raise

    @property
    def replica_wait(self) -> float:
        """Seconds the child's requests wait for a replica when none is left."""
        return self._replica_wait

    @replica_wait.setter
    def replica_wait(self, seconds: float) -> None:
        self._owner.call("replica_wait", float(seconds))
        self._replica_wait = float(seconds)

    @property
    def retries(self) -> int:
        """Requests the child's client re-sent after a failure, since the start."""
        return int(self._owner.counters()["retries"])

    async def abort(self) -> Any:
        """Abort the child's requests in flight (the run ends)."""
        return await asyncio.wrap_future(self._owner.submit("control", "abort"))


class ProducerProcess:
    """A rollout producer in a spawned child process, for the asynchronous modes' rollout thread.

    It offers what :class:`~polyrl.trainer.rl.asynchronous.AheadRollout` uses of a
    :class:`~polyrl.trainer.rl.rollout.RolloutProducer`: :meth:`produce_group`, a ``client``
    the replicas route, the ``resume_aborted`` and ``stopping`` flags, the
    ``resumed_samples`` count, ``pad_id`` and an event loop of its own for the rollout thread.

    Args:
        cfg: the run's configuration.
        urls: the rollout replicas' URLs.
        model_dir: the policy's directory (the child loads its tokenizer and processor).
        api_key: the replicas' key.
        reward_fn: the trainer's reward function override; it must pickle (a
            ``"file.py:function"`` spec, a module-level function or a list of them).
        start_timeout_s: seconds the child may take to start.

    Raises:
        ConfigError: ``reward_fn`` cannot be sent to a process.
        RuntimeError: the child failed to start (its traceback is in the message).
    """

    def __init__(
        self,
        cfg: PolyRLConfig,
        urls: Sequence[str],
        model_dir: Any,
        api_key: str | None = None,
        reward_fn: Any = None,
        start_timeout_s: float = 300.0,
    ) -> None:
        setup = {
            "cfg": cfg,
            "urls": list(urls),
            "model_dir": str(model_dir),
            "api_key": api_key,
            "reward_fn": reward_fn,
        }
        try:
            setup_bytes = pickle.dumps(setup, protocol=5)
        except Exception as exc:  # noqa: BLE001 - a lambda, a closure, a function in __main__
            raise ConfigError(
                "async.producer=process sends the reward function to the producer process, "
                f"which cannot take {reward_fn!r} ({exc}); pass a 'file.py:function' spec or "
                "a module-level function, or use async.producer=thread",
                key="async.producer",
            ) from None
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_child_main,
            args=(child, setup_bytes),
            name="polyrl-rollout-producer",
            daemon=False,  # it starts reward worker processes of its own
        )
        self.process.start()
        child.close()
        self.conn = parent
        self._ids = itertools.count()
        self._pending: dict[int, cf.Future] = {}
        self._lock = threading.Lock()
        self._dead: str | None = None
        # Set by close(): the child's exit that follows is the one asked for, not a crash.
        self._closing = False
        if not parent.poll(start_timeout_s):
            self._stop()
            raise RuntimeError(f"the rollout producer process did not start in {start_timeout_s} s")
        try:
            kind, _, payload = pickle.loads(parent.recv_bytes())
        except (EOFError, OSError):
            kind, payload = "failed", f"it exited with code {self._exit_code()}"
        if kind != "ready":
            self._stop()
            raise RuntimeError(f"the rollout producer process failed to start:\n{payload}")
        #: The policy's padding id (the child's tokenizer's).
        self.pad_id: int = int(payload)
        #: The rollout thread's event loop (the requests themselves run in the child).
        self._loop = asyncio.new_event_loop()
        self.client = _ProcessClient(self)
        self._resume_aborted = False
        self._stopping = False
        self._reader = threading.Thread(
            target=self._read, name="polyrl-producer-replies", daemon=True
        )
        self._reader.start()

    # ------------------------------------------------------------------ requests
    def submit(self, kind: str, *args: Any) -> cf.Future:
        """Send a request to the child; the future resolves with its answer."""
        future: cf.Future = cf.Future()
        call_id = next(self._ids)
        data = pickle.dumps((kind, call_id, *args), protocol=5)
        with self._lock:
            if self._dead is not None:
                future.set_exception(RuntimeError(self._dead))
                return future
            self._pending[call_id] = future
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):
                self._pending.pop(call_id, None)
                future.set_exception(RuntimeError("the rollout producer process is gone"))
        return future

    def call(self, name: str, *args: Any) -> Any:
        """Make control call ``name`` in the child and wait for its answer."""
        return self.submit("control", name, *args).result(timeout=_CALL_TIMEOUT_S)

    def counters(self) -> dict[str, int]:
        """Return the child's ``retries`` and ``resumed_samples``, since the start."""
        return self.call("counters")

    async def produce_group(
        self,
        item: Mapping[str, Any],
        n: int,
        temperature: float,
        seed: int,
        greedy_baseline: bool = False,
    ) -> tuple[Any, dict[str, float]]:
        """Generate and score one prompt group in the child; return it as the thread would.

        See :meth:`~polyrl.trainer.rl.rollout.RolloutProducer.produce_group`.
        """
        return await asyncio.wrap_future(
            self.submit("group", dict(item), n, temperature, seed, greedy_baseline)
        )

    def _read(self) -> None:
        while True:
            try:
                kind, call_id, payload = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                if self._closing:
                    self._fail_all(_STOPPED)
                else:
                    self._fail_all(
                        f"the rollout producer process exited (code {self._exit_code()}) with "
                        "requests pending"
                    )
                return
            except Exception as exc:  # noqa: BLE001 - an answer that does not unpickle here
                self._fail_all(f"unreadable answer from the rollout producer process: {exc}")
                return
            with self._lock:
                future = self._pending.pop(call_id, None)
            if future is None:
                continue
            if kind == "ok":
                future.set_result(payload)
            else:
                future.set_exception(_child_error(payload))

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(RuntimeError(reason))

    def _exit_code(self) -> int | None:
        self.process.join(timeout=0.5)
        return self.process.exitcode

    # ------------------------------------------------------------------ flags
    @property
    def resume_aborted(self) -> bool:
        """Continue samples aborted by a weight update (see ``RolloutProducer``)."""
        return self._resume_aborted

    @resume_aborted.setter
    def resume_aborted(self, value: bool) -> None:
        self.call("resume_aborted", bool(value))
        self._resume_aborted = bool(value)

    @property
    def stopping(self) -> bool:
        """Set when the run ends: aborted samples are then not continued."""
        return self._stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self._stopping = bool(value)
        # Set as the run ends: a child already gone has nothing left to stop.
        with contextlib.suppress(RuntimeError, cf.TimeoutError):
            self.call("stopping", bool(value))

    @property
    def resumed_samples(self) -> int:
        """Samples the child continued after an abort, since the start."""
        return int(self.counters()["resumed_samples"])

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Ask the child to close its client and reward workers and exit; stop it otherwise."""
        self._closing = True
        if self.process.is_alive():
            try:
                with self._lock:
                    self.conn.send_bytes(pickle.dumps(("exit",)))
            except (OSError, ValueError):
                pass
        self._stop()
        if not self._loop.is_closed():
            self._loop.close()

    def _stop(self, grace_s: float = 10.0) -> None:
        self.process.join(timeout=grace_s)
        for escalate in ("terminate", "kill"):
            if not self.process.is_alive():
                break
            getattr(self.process, escalate)()
            self.process.join(timeout=2.0)
        self._fail_all(_STOPPED)
        self.conn.close()
