"""Weight-transfer endpoints registered onto the rollout server's FastAPI app.

``POST /weights/begin`` ``{"transfer_id", "version"}`` → ``{"weight_version"}`` (now serving);
``POST /weights/bucket`` ``{"meta": BucketMeta, "source": {"kind": "shm", "name"} |
{"kind": "disk", "path"}}`` → ``{"buckets": n}``; ``POST /weights/commit``
``{"transfer_id", "version"}`` → ``{"weight_version"}``; ``POST /weights/abort``
``{"transfer_id"?}``; ``GET /weights/status``; ``POST /weights/dist/init``
``{"host", "port", "rank", "world_size", "timeout"?}`` joins the sender's gloo group (``dist``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from datetime import timedelta
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from polyrl.weights.base import BucketMeta, WeightTransferError
from polyrl.weights.receiver import NameMap, WeightReceiver

__all__ = ["register_weight_routes"]


def _open_shm(name: str) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    seg = shared_memory.SharedMemory(name=name)
    # The sender owns the segment; without this the receiver's tracker would unlink it at exit.
    resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    return seg


class _DistState:
    """A replica's end of the sender's gloo group, and the broadcast order within it."""

    def __init__(self) -> None:
        self.group: Any = None
        self.store: Any = None
        self.timeout = 120.0
        self.next_index = 0
        self.cond = threading.Condition()

    def init(self, host: str, port: int, rank: int, world_size: int, timeout: float) -> None:
        import torch.distributed as dist

        delta = timedelta(seconds=timeout)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=delta)
        group = dist.ProcessGroupGloo(store, rank, world_size, delta)
        with self.cond:
            self.group, self.store, self.timeout, self.next_index = group, store, timeout, 0

    def reset(self) -> None:
        with self.cond:
            self.next_index = 0
            self.cond.notify_all()

    def receive(self, receiver: WeightReceiver, meta: BucketMeta) -> None:
        # Collectives must be issued in the sender's order; bucket requests may arrive out of
        # order (two are in flight), so each waits for its turn before joining the broadcast.
        with self.cond:
            if self.group is None:
                raise WeightTransferError(
                    "no dist group on this replica; the sender must POST /weights/dist/init first"
                )
            if not self.cond.wait_for(lambda: self.next_index == meta.index, self.timeout):
                raise WeightTransferError(
                    f"bucket {meta.index}: timed out waiting for bucket {self.next_index}"
                )
            buf = torch.empty(meta.nbytes, dtype=torch.uint8)
            work = self.group.broadcast(buf, 0)
            self.next_index += 1
            self.cond.notify_all()
        work.wait()
        receiver.receive(meta, memoryview(buf.numpy()))


def _read_source(
    receiver: WeightReceiver, meta: BucketMeta, source: dict[str, Any], dist_state: _DistState
) -> None:
    kind = source.get("kind")
    if kind == "dist":
        dist_state.receive(receiver, meta)
    elif kind == "cuda_ipc":
        # UNTESTED (no GPU where this was written): map the sender's CUDA buffer by handle.
        # The handle is a pickle, i.e. code execution for whoever can POST here: opt-in only.
        if os.environ.get("POLYRL_WEIGHTS_CUDA_IPC") != "1":
            raise WeightTransferError(
                "cuda_ipc buckets are refused: set POLYRL_WEIGHTS_CUDA_IPC=1 on the rollout "
                "server to accept them (their handles are pickles; trusted senders only)"
            )
        import base64
        import pickle

        rebuild, args = pickle.loads(base64.b64decode(str(source["handle"])))  # noqa: S301
        gpu = rebuild(*args)
        receiver.receive(meta, memoryview(gpu[: meta.nbytes].cpu().numpy()))
    elif kind == "shm":
        try:
            seg = _open_shm(str(source["name"]))
        except (FileNotFoundError, KeyError) as exc:
            raise WeightTransferError(
                f"bucket {meta.index}: shared memory {source.get('name')!r} is gone: {exc}"
            ) from exc
        try:
            receiver.receive(meta, seg.buf)
        finally:
            seg.close()
    elif kind == "disk":
        from safetensors.torch import load_file

        try:
            data = load_file(str(source["path"]))["bucket"]
        except (OSError, KeyError) as exc:
            raise WeightTransferError(
                f"bucket {meta.index}: cannot read {source.get('path')!r}: {exc}"
            ) from exc
        receiver.receive(meta, memoryview(data.numpy()))
    else:
        raise WeightTransferError(
            f"unknown bucket source kind {kind!r}; expected shm, dist, cuda_ipc or disk"
        )


def register_weight_routes(
    app: FastAPI, backend: Any, name_map: NameMap | None = None
) -> WeightReceiver | None:
    """Add the ``/weights/*`` endpoints for ``backend`` (one with ``load_weights``).

    Returns the receiver, or ``None`` when the backend cannot load tensors directly.
    """
    if not hasattr(backend, "load_weights"):
        return None
    loop_holder: dict[str, asyncio.AbstractEventLoop] = {}

    def load(pairs: list[tuple[str, torch.Tensor]], version: int) -> int:
        coro = backend.load_weights(pairs, None if version < 0 else version)
        return asyncio.run_coroutine_threadsafe(coro, loop_holder["loop"]).result()

    receiver = WeightReceiver(load, lambda: int(backend.weight_version), name_map)
    dist_state = _DistState()
    app.state.weight_receiver = receiver

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body() or b"{}")
        except json.JSONDecodeError as exc:
            raise WeightTransferError(f"malformed JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise WeightTransferError("the body must be a JSON object")
        return body

    def fail(exc: Exception) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": str(exc),
                    "type": "weight_transfer_error",
                    "param": None,
                    "code": None,
                }
            },
            status_code=400,
        )

    @app.post("/weights/begin")
    async def begin(request: Request) -> Any:
        try:
            body = await body_of(request)
            current = receiver.begin(str(body["transfer_id"]), int(body.get("version", -1)))
            dist_state.reset()
        except (WeightTransferError, KeyError, ValueError, TypeError) as exc:
            return fail(exc)
        return {"weight_version": current}

    @app.post("/weights/bucket")
    async def bucket(request: Request) -> Any:
        try:
            body = await body_of(request)
            meta = BucketMeta.from_dict(body["meta"])
            await asyncio.to_thread(_read_source, receiver, meta, dict(body["source"]), dist_state)
        except (WeightTransferError, KeyError, ValueError, TypeError) as exc:
            return fail(exc)
        return {"buckets": meta.index + 1}

    @app.post("/weights/commit")
    async def commit(request: Request) -> Any:
        loop_holder["loop"] = asyncio.get_running_loop()
        try:
            body = await body_of(request)
            version = await asyncio.to_thread(
                receiver.commit,
                str(body["transfer_id"]),
                int(body.get("version", -1)),
                None if body.get("buckets") is None else int(body["buckets"]),
            )
        except Exception as exc:  # noqa: BLE001 - engine validation errors name the tensors
            return fail(exc)
        return {"weight_version": version}

    @app.post("/weights/dist/init")
    async def dist_init(request: Request) -> Any:
        try:
            body = await body_of(request)
            await asyncio.to_thread(
                dist_state.init,
                str(body["host"]),
                int(body["port"]),
                int(body["rank"]),
                int(body["world_size"]),
                float(body.get("timeout", 120.0)),
            )
        except (WeightTransferError, KeyError, ValueError, TypeError, RuntimeError) as exc:
            return fail(exc)
        return {"rank": int(body["rank"])}

    @app.post("/weights/abort")
    async def abort(request: Request) -> Any:
        body = await body_of(request)
        return {"aborted": receiver.abort(body.get("transfer_id"))}

    @app.get("/weights/status")
    async def status() -> Any:
        return receiver.status()

    return receiver
