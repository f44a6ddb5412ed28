"""Weight-transfer endpoints registered onto the rollout server's FastAPI app.

``POST /weights/begin`` ``{"transfer_id", "version", "mode"?, "inflight"?, "stall_timeout"?,
"measure_memory"?, "direct"?}`` → ``{"weight_version", "direct"?}`` (now serving; with
``direct`` asked and a staged CPU replica, the shared arena of its shadows that a same-host
sender writes into: ``{"path", "size", "tensors": {name: [offset, shape, dtype]}}``, see
:mod:`polyrl.core.arena`); ``POST /weights/bucket``
``{"meta": BucketMeta, "source": {"kind": "shm", "name"} | {"kind": "disk", "path"} |
{"kind": "dist"} | {"kind": "cuda_ipc", "handle", "device_uuid"?}}`` → ``{"buckets": n}``;
``POST /weights/commit`` ``{"transfer_id", "version", "buckets", "direct"?: {name: crc32 |
null}}`` → ``{"weight_version", "received": {source kind: buckets}}``;
``POST /weights/abort`` ``{"transfer_id"?, "reason"?}``; ``GET /weights/status`` (the transfer
in progress, the last one with its measured memory, ``shm_mapped``: the senders' shared-memory
segments this replica keeps mapped, ``minor_faults``: the process's page faults so far);
``POST /weights/dist/init`` ``{"host", "port", "rank", "world_size", "timeout"?, "backend"?}``
joins the sender's group.

The receive path is the one the backend declares in its ``weight_receive``
(:data:`polyrl.core.rollout_api.WeightReceive`): ``stream`` (the native engine:
``begin_weight_update``, ``weight_destination``, ``commit_weight_update``,
``abort_weight_update``) receives every chunk straight into place; ``shared_arena`` (vLLM with
``weight_load == "memory"``, its default) receives into a shared-memory arena handed to its
workers in place at commit; ``safetensors_dir`` (vLLM with ``weight_load == "disk"``, SGLang:
backends that reload from a directory with ``update_weights(path)``) stages the set as a
safetensors directory reloaded once at commit (:mod:`polyrl.weights.staging`); ``load_fn``
gives an atomic ``load_weights`` the whole set at commit, in temporaries; ``none`` adds no
routes.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import resource
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from polyrl.core.cuda import open_cuda_tensor
from polyrl.core.http_guard import json_request_body, parse_json
from polyrl.core.rollout_api import WEIGHT_RECEIVE_PATHS
from polyrl.weights.base import CUDA_IPC_ENV, BucketMeta, WeightTransferError
from polyrl.weights.receiver import LoadFnTarget, NameMap, WeightReceiver, WeightTarget
from polyrl.weights.transports import (
    bucket_file_name,
    group_device,
    make_group,
    read_bucket_file,
)

__all__ = ["EngineTarget", "register_weight_routes"]


class EngineTarget(WeightTarget):
    """:class:`WeightTarget` over a backend whose ``engine`` streams updates (native)."""

    def __init__(self, backend: Any):
        self.backend = backend

    @property
    def engine(self) -> Any:
        """The backend's engine (created when the backend starts)."""
        engine = getattr(self.backend, "engine", None)
        if engine is None:
            raise WeightTransferError("the rollout backend is not started yet")
        return engine

    def current_version(self) -> int:
        """Return the engine's version."""
        return int(self.backend.weight_version)

    def begin(self, transfer_id: str, mode: str, inflight: str) -> None:
        """Apply the in-flight policy; pause for inplace."""
        self.engine.begin_weight_update(transfer_id, mode, inflight)

    def destination(
        self, transfer_id: str, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """Shadow (staged) or live (inplace) storage of parameter ``name``."""
        return self.engine.weight_destination(transfer_id, name)

    def commit(self, transfer_id: str, names: Sequence[str], version: int) -> int:
        """Swap in (staged) or finish (inplace) between two steps."""
        return int(
            self.engine.commit_weight_update(transfer_id, names, None if version < 0 else version)
        )

    def abort(self, transfer_id: str, reason: str) -> None:
        """Drop the update (inplace: refuse requests until a later one commits)."""
        self.engine.abort_weight_update(transfer_id, reason)

    def held_bytes(self) -> int:
        """Bytes of the parameter shadows."""
        return int(self.engine.runner.shadow_bytes)

    def shared_layout(self, transfer_id: str) -> dict[str, Any] | None:
        """Offer the engine's shadows as a shared arena (CPU replicas), else ``None``."""
        return self.engine.shared_weight_destinations(transfer_id)


def _open_shm(name: str) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    seg = shared_memory.SharedMemory(name=name)
    # The sender owns the segment; without this the receiver's tracker would unlink it at exit.
    resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    return seg


class _ShmCache:
    """The sender's segments, mapped once and kept mapped across buckets and transfers.

    Mapping a segment afresh for every transfer made the replica fault in every page of both
    buckets again on each update (and the first read of a fresh mapping runs at a fraction of
    the copy bandwidth). A sender keeps its two segments for its lifetime, so their mappings
    are kept here too, at most ``keep`` of them (least recently used are unmapped first), and a
    segment whose name is gone from ``/dev/shm`` (its sender closed or died) is unmapped at
    the next ``begin``/abort: the replica never pins more than ``keep`` buckets of a dead
    sender's memory.
    """

    def __init__(self, keep: int = 4) -> None:
        self.lock = threading.Lock()
        self.keep = keep
        self.segments: dict[str, shared_memory.SharedMemory] = {}

    def get(self, name: str, nbytes: int) -> shared_memory.SharedMemory:
        with self.lock:
            seg = self.segments.pop(name, None)
            if seg is not None and seg.size < nbytes:
                self._close(seg)  # not ours to resize: map it again at its new size
                seg = None
            if seg is None:
                seg = _open_shm(name)
            self.segments[name] = seg  # most recently used last
            while len(self.segments) > self.keep:
                self._close(self.segments.pop(next(iter(self.segments))))
            return seg

    @staticmethod
    def _close(seg: shared_memory.SharedMemory) -> None:
        try:
            seg.close()
        except BufferError:  # a bucket copy still holds it: the mapping dies with it
            pass

    def names(self) -> list[str]:
        """Names of the segments mapped now (least recently used first)."""
        with self.lock:
            return list(self.segments)

    def drop_stale(self) -> None:
        """Unmap segments their sender has unlinked (closed transport or dead sender)."""
        with self.lock:
            for name in list(self.segments):
                if not os.path.exists("/dev/shm/" + name.lstrip("/")):
                    self._close(self.segments.pop(name))

    def close(self) -> None:
        with self.lock:
            for seg in self.segments.values():
                self._close(seg)
            self.segments.clear()


class _DistState:
    """A replica's end of the sender's group, and the broadcast order within it."""

    def __init__(self) -> None:
        self.group: Any = None
        self.store: Any = None
        self.timeout = 120.0
        self.device = torch.device("cpu")
        self.next_index = 0
        self.transfer: str | None = None
        self.cond = threading.Condition()

    def init(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout: float,
        backend: str = "gloo",
        device: str | None = None,
    ) -> None:
        import torch.distributed as dist

        delta = timedelta(seconds=timeout)
        # The sender names no device for the replica: "cuda" is this process's current GPU,
        # indexed so that set_device accepts it and the scratch buffers compare equal.
        where = group_device(backend, device)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=delta)
        group = make_group(backend, store, rank, world_size, delta, str(where))
        with self.cond:
            old, self.group = self.group, group
            self.store, self.timeout, self.next_index = store, timeout, 0
            self.device = where
        if old is not None:
            old.shutdown()  # a new sender's group replaces the last one's

    def reset(self, transfer_id: str | None = None) -> None:
        with self.cond:
            self.next_index = 0
            self.transfer = transfer_id
            self.cond.notify_all()

    def receive(self, receiver: WeightReceiver, meta: BucketMeta) -> None:
        # Collectives must be issued in the sender's order; bucket requests may arrive out of
        # order (two are in flight), so each waits for its turn before joining the broadcast.
        with self.cond:
            if self.group is None:
                raise WeightTransferError(
                    "no dist group on this replica; the sender must POST /weights/dist/init first"
                )
            turn = lambda: self.next_index == meta.index or self.transfer != meta.transfer_id  # noqa: E731
            if not self.cond.wait_for(turn, self.timeout):
                raise WeightTransferError(
                    f"bucket {meta.index}: timed out waiting for bucket {self.next_index}"
                )
            if self.transfer != meta.transfer_id:
                # A bucket of a superseded transfer must not take a broadcast of the new one.
                raise WeightTransferError(
                    f"bucket {meta.index} belongs to transfer {meta.transfer_id}, which was "
                    f"superseded by {self.transfer}"
                )
            # Two reused receive buffers (by bucket parity): the sender never has more than
            # two buckets in flight, and reuses a slot only after this replica answered.
            buf = receiver.scratch(meta.index % 2, meta.nbytes, self.device)
            work = self.group.broadcast(buf, 0)
            self.next_index += 1
            self.cond.notify_all()
        try:
            work.wait()
        except Exception as exc:
            with self.cond:
                self.group = None  # a broken group (sender died): the next sender re-inits
            raise WeightTransferError(f"bucket {meta.index}: broadcast failed: {exc}") from exc
        receiver.receive(meta, buf)
        if buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()


def _read_source(
    receiver: WeightReceiver,
    meta: BucketMeta,
    source: dict[str, Any],
    dist_state: _DistState,
    shm: _ShmCache,
) -> None:
    kind = source.get("kind")
    if kind == "dist":
        dist_state.receive(receiver, meta)
    elif kind == "cuda_ipc":
        # Untested on GPU: map the sender's CUDA buffer by handle, on this process's index of
        # the sender's GPU (the UUID says which).
        # The handle is a pickle, i.e. code execution for whoever can POST here: opt-in only.
        if os.environ.get(CUDA_IPC_ENV) != "1":
            raise WeightTransferError(
                f"cuda_ipc buckets are refused: set {CUDA_IPC_ENV}=1 on the rollout "
                "server to accept them (their handles are pickles; trusted senders only)"
            )
        device_uuid = source.get("device_uuid")
        # torch caches the mapping of a handle it has opened before.
        gpu = open_cuda_tensor(
            str(source["handle"]), None if device_uuid is None else str(device_uuid)
        )
        receiver.receive(meta, gpu[: meta.nbytes])
        torch.cuda.current_stream(gpu.device).synchronize()  # done before the sender reuses it
    elif kind == "shm":
        name = str(_required(source, "name", "source"))
        if "/" in name.lstrip("/") or name in ("", ".", ".."):
            raise WeightTransferError(
                f"bucket {meta.index}: refusing shared memory name {name!r}: a segment is named "
                "by one path component (it lives in /dev/shm), not by a path"
            )
        try:
            seg = shm.get(name, meta.nbytes)
        except (FileNotFoundError, KeyError) as exc:
            raise WeightTransferError(
                f"bucket {meta.index}: shared memory {source.get('name')!r} is gone: {exc}"
            ) from exc
        receiver.receive(meta, seg.buf)
    elif kind == "disk":
        path = str(_required(source, "path", "source"))
        expected = bucket_file_name(meta.transfer_id, meta.index)
        if os.path.basename(path) != expected:
            raise WeightTransferError(
                f"bucket {meta.index}: refusing disk path {path!r}: the disk transport sends "
                f"bucket {meta.index} of transfer {meta.transfer_id!r} as a file named "
                f"{expected!r}, and no other file is read"
            )
        try:
            data = read_bucket_file(path, lambda n: receiver.scratch(meta.index % 2, n))
        except (OSError, KeyError, ValueError, WeightTransferError) as exc:
            raise WeightTransferError(f"bucket {meta.index}: cannot read {path!r}: {exc}") from exc
        receiver.receive(meta, data)
    else:
        raise WeightTransferError(
            f"unknown bucket source kind {kind!r}; expected shm, dist, cuda_ipc or disk"
        )


def _required(body: dict[str, Any], name: str, within: str = "") -> Any:
    """Return ``body[name]``; a missing field is a request error that names it."""
    if name not in body:
        field = f"{within}.{name}" if within else name
        raise WeightTransferError(
            f"missing field {field!r} in the request body ({within or 'it'} has "
            f"{sorted(body) or 'no fields'})"
        )
    return body[name]


def _direct_of(body: dict[str, Any]) -> dict[str, int | None]:
    """Parse the commit's ``direct`` field: names written into the arena, with CRC32s."""
    direct = body.get("direct") or {}
    if not isinstance(direct, dict):
        raise WeightTransferError(
            f"'direct' must be an object mapping tensor names to a CRC32 or null, got "
            f"{type(direct).__name__}"
        )
    return {str(k): None if v is None else int(v) for k, v in direct.items()}


class _Body(BaseModel):
    # Documentation of the bodies (the handlers read and check them themselves).
    model_config = ConfigDict(extra="allow")


class _BeginBody(_Body):
    transfer_id: str
    version: int = -1
    mode: str = "staged"
    inflight: str = "keep"
    stall_timeout: float | None = None
    measure_memory: bool = False
    direct: bool = False


class _BucketBody(_Body):
    meta: dict[str, Any]
    source: dict[str, Any]


class _CommitBody(_Body):
    transfer_id: str
    version: int = -1
    buckets: int | None = None
    direct: dict[str, int | None] | None = None


class _DistInitBody(_Body):
    host: str
    port: int
    rank: int
    world_size: int
    timeout: float = 120.0
    backend: str = "gloo"
    device: str | None = None


class _AbortBody(_Body):
    transfer_id: str | None = None
    reason: str | None = None


#: What each receive path calls on the backend (checked once, when the routes are added).
_RECEIVE_NEEDS: dict[str, tuple[str, ...]] = {
    "stream": ("engine", "weight_version"),
    "shared_arena": ("load_weights", "model_dir", "weight_version"),
    "safetensors_dir": ("update_weights", "model_dir", "weight_version"),
    "load_fn": ("load_weights", "weight_version"),
    "none": (),
}


_MISSING = object()


def _static_attr(obj: Any, name: str) -> Any:
    return inspect.getattr_static(obj, name, _MISSING)


def _declared_receive(backend: Any) -> str:
    """Return the receive path ``backend`` declares; raise a clear error for an unusable one."""
    name = type(backend).__name__
    receive = getattr(backend, "weight_receive", None)
    if receive not in WEIGHT_RECEIVE_PATHS:
        raise TypeError(
            f"rollout backend {name} declares weight_receive={receive!r}: set it to one of "
            f"{', '.join(WEIGHT_RECEIVE_PATHS)} (polyrl.core.rollout_api.WeightReceive) to say "
            "how weights pushed to its replica reach it ('none': the replica takes none)"
        )
    # Looked up statically: a backend's properties (weight_version) may refuse before start.
    missing = [a for a in _RECEIVE_NEEDS[receive] if _static_attr(backend, a) is _MISSING]
    if missing:
        raise TypeError(
            f"rollout backend {name} declares weight_receive={receive!r} but has no "
            f"{', '.join(missing)}"
        )
    return receive


def register_weight_routes(
    app: FastAPI,
    backend: Any,
    name_map: NameMap | None = None,
    stall_timeout: float = 120.0,
) -> WeightReceiver | None:
    """Add the ``/weights/*`` endpoints for ``backend``, on the path it declares.

    ``backend.weight_receive`` (see the module docstring) picks the target: ``stream`` streams
    into the backend's engine; ``shared_arena`` receives into a shared-memory arena given to
    ``load_weights`` at commit; ``safetensors_dir`` stages a safetensors directory reloaded
    once at commit with ``update_weights``; ``load_fn`` collects temporaries for
    ``load_weights``. Returns the receiver, or ``None`` for ``none`` (no routes added).

    Raises:
        TypeError: the backend declares no ``weight_receive`` (or an unknown one), or lacks
            what its declared path calls.
    """
    loop_holder: dict[str, asyncio.AbstractEventLoop] = {}

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop_holder["loop"]).result()

    receive = _declared_receive(backend)
    target: WeightTarget
    if receive == "none":
        return None
    if receive == "stream":
        target = EngineTarget(backend)
    elif receive == "shared_arena":
        # vLLM: the transfer lands in shared memory, its workers load it from there in place.
        from polyrl.weights.staging import SharedArenaTarget

        target = SharedArenaTarget(backend, run)
    elif receive == "safetensors_dir":
        # A safetensors directory, reloaded once at commit.
        from polyrl.weights.staging import SafetensorsDirTarget

        target = SafetensorsDirTarget(backend, run)
    else:  # load_fn

        def load(pairs: list[tuple[str, torch.Tensor]], version: int) -> int:
            return run(backend.load_weights(pairs, None if version < 0 else version))

        target = LoadFnTarget(load, lambda: int(backend.weight_version))
    receiver = WeightReceiver(target, name_map, stall_timeout=stall_timeout)
    dist_state = _DistState()
    shm = _ShmCache()
    # Buckets of the transfer in progress by source kind ("cuda_ipc", "shm", ...), reported
    # by the commit: what reached this replica, and how.
    received: dict[str, int] = {}
    # Every abort (the sender's, a stall, a superseding begin) unmaps a dead sender's segments.
    receiver.on_abort = lambda transfer_id: shm.drop_stale()
    app.state.weight_receiver = receiver

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            # Depth-capped; huge integers and bad encodings are errors too, never a 500.
            body = parse_json(await request.body() or b"{}")
        except ValueError as exc:
            raise WeightTransferError(str(exc)) from exc
        if not isinstance(body, dict):
            raise WeightTransferError("the body must be a JSON object")
        return body

    def fail(exc: Exception) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": str(getattr(exc, "message", None) or exc),
                    "type": "weight_transfer_error",
                    "param": None,
                    "code": None,
                }
            },
            status_code=400,
        )

    @app.post("/weights/begin", openapi_extra=json_request_body(_BeginBody))
    async def begin(request: Request) -> Any:
        loop_holder["loop"] = asyncio.get_running_loop()
        try:
            body = await body_of(request)
            timeout = body.get("stall_timeout")
            current = await asyncio.to_thread(
                receiver.begin,
                str(_required(body, "transfer_id")),
                int(body.get("version", -1)),
                str(body.get("mode", "staged")),
                str(body.get("inflight", "keep")),
                None if timeout is None else float(timeout),
                bool(body.get("measure_memory", False)),
            )
            shm.drop_stale()
            dist_state.reset(str(_required(body, "transfer_id")))
            received.clear()
            offer = None
            if body.get("direct"):
                offer = await asyncio.to_thread(
                    receiver.offer_direct, str(_required(body, "transfer_id"))
                )
        except Exception as exc:  # noqa: BLE001 - engine validation errors name the problem
            return fail(exc)
        answer: dict[str, Any] = {"weight_version": current}
        if offer is not None:
            answer["direct"] = offer
        return answer

    @app.post("/weights/bucket", openapi_extra=json_request_body(_BucketBody))
    async def bucket(request: Request) -> Any:
        try:
            body = await body_of(request)
            meta = BucketMeta.from_dict(_required(body, "meta"))
            source = dict(_required(body, "source"))
            await asyncio.to_thread(_read_source, receiver, meta, source, dist_state, shm)
        except Exception as exc:  # noqa: BLE001 - unknown names, shapes, checksums, sources
            return fail(exc)
        kind = str(source.get("kind"))
        received[kind] = received.get(kind, 0) + 1  # on the event loop: no race
        return {"buckets": meta.index + 1}

    @app.post("/weights/commit", openapi_extra=json_request_body(_CommitBody))
    async def commit(request: Request) -> Any:
        loop_holder["loop"] = asyncio.get_running_loop()
        try:
            body = await body_of(request)
            direct = _direct_of(body)
            version = await asyncio.to_thread(
                receiver.commit,
                str(_required(body, "transfer_id")),
                int(body.get("version", -1)),
                None if body.get("buckets") is None else int(body["buckets"]),
                direct,
            )
        except Exception as exc:  # noqa: BLE001 - engine validation errors name the tensors
            return fail(exc)
        if direct:
            # Written by the sender straight into this replica's shared arena: no buckets.
            received["shm_direct"] = received.get("shm_direct", 0) + len(direct)
        return {"weight_version": version, "received": dict(received)}

    @app.post("/weights/dist/init", openapi_extra=json_request_body(_DistInitBody))
    async def dist_init(request: Request) -> Any:
        try:
            body = await body_of(request)
            await asyncio.to_thread(
                dist_state.init,
                str(_required(body, "host")),
                int(_required(body, "port")),
                int(_required(body, "rank")),
                int(_required(body, "world_size")),
                float(body.get("timeout", 120.0)),
                str(body.get("backend", "gloo")),
                body.get("device"),
            )
        except (WeightTransferError, KeyError, ValueError, TypeError, RuntimeError) as exc:
            return fail(exc)
        return {"rank": int(_required(body, "rank"))}

    @app.post("/weights/abort", openapi_extra=json_request_body(_AbortBody, required=False))
    async def abort(request: Request) -> Any:
        try:
            body = await body_of(request)
        except WeightTransferError as exc:
            return fail(exc)
        loop_holder["loop"] = asyncio.get_running_loop()
        reason = str(body.get("reason") or "aborted by the sender")
        aborted = await asyncio.to_thread(receiver.abort, body.get("transfer_id"), reason)
        return {"aborted": aborted}

    @app.get("/weights/status")
    async def status() -> Any:
        # In a worker thread: the receiver's lock is held through a commit, and a commit may
        # wait for this event loop (vLLM's reload runs on it), so blocking here would deadlock.
        state = await asyncio.to_thread(receiver.status)
        return {
            **state,
            "shm_mapped": shm.names(),
            # Page faults of this process so far: a machine-independent cost of an update.
            "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
        }

    return receiver
