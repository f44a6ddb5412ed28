"""Built-in transports: ``shm`` (shared memory), ``dist`` (gloo broadcast), ``disk`` (files).

Both use HTTP to the rollout servers as control channel (routes in
:mod:`polyrl.weights.server_routes`); each bucket is posted to every replica concurrently and
the sender only reuses a buffer once all replicas answered for it.
"""

from __future__ import annotations

import abc
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import httpx
import torch

from polyrl.weights.base import BucketMeta, Transport, WeightTransferError, register_transport

__all__ = [
    "CudaIpcTransport",
    "DiskTransport",
    "DistTransport",
    "HttpControlTransport",
    "ShmTransport",
]


class HttpControlTransport(Transport):
    """Base for transports whose control channel is HTTP to each replica.

    Args:
        urls: rollout server base URLs.
        timeout: seconds per control request.
        api_key: bearer token for the servers.
    """

    def __init__(self, urls: Sequence[str], timeout: float = 120.0, api_key: str | None = None):
        if isinstance(urls, str) or not urls:
            raise ValueError(f"urls must be a non-empty list of server URLs, got {urls!r}")
        self.urls = [u.rstrip("/") for u in urls]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=timeout, headers=headers)
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(self.urls)))

    def _post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = self._http.post(url + path, json=body)
        if resp.status_code != 200:
            try:
                message = resp.json()["error"]["message"]
            except Exception:  # noqa: BLE001 - fall back to the raw text
                message = resp.text
            raise WeightTransferError(f"{url}{path} answered {resp.status_code}: {message}")
        return resp.json()

    def _all(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        futures = [self._pool.submit(self._post, u, path, body) for u in self.urls]
        return [f.result() for f in futures]

    def begin(self, transfer_id: str, version: int) -> list[int]:
        """Start the transfer on every replica; return their serving versions."""
        answers = self._all("/weights/begin", {"transfer_id": transfer_id, "version": version})
        return [int(a["weight_version"]) for a in answers]

    @abc.abstractmethod
    def _source(self, slot: int, meta: BucketMeta) -> dict[str, Any]:
        """Where the replica reads bucket ``slot`` from (transport-specific JSON)."""

    def send_bucket(self, slot: int, meta: BucketMeta) -> Callable[[], None]:
        """Post the bucket to every replica in the background; the callable waits for all."""
        body = {"meta": meta.to_dict(), "source": self._source(slot, meta)}
        futures: list[Future[dict[str, Any]]] = [
            self._pool.submit(self._post, u, "/weights/bucket", body) for u in self.urls
        ]

        def wait() -> None:
            for f in futures:
                f.result()
            self._sent(slot, meta)

        return wait

    def _sent(self, slot: int, meta: BucketMeta) -> None:  # noqa: B027 - optional hook
        """Run once every replica holds bucket ``meta``."""

    def commit(self, transfer_id: str, version: int, buckets: int) -> list[int]:
        """Switch every replica concurrently; return their new versions."""
        body = {"transfer_id": transfer_id, "version": version, "buckets": buckets}
        answers = self._all("/weights/commit", body)
        return [int(a["weight_version"]) for a in answers]

    def abort(self, transfer_id: str) -> None:
        """Drop the staging on every replica."""
        self._all("/weights/abort", {"transfer_id": transfer_id})

    def close(self) -> None:
        """Close the HTTP client and the worker threads."""
        self._pool.shutdown(wait=True)
        self._http.close()


@register_transport("shm")
class ShmTransport(HttpControlTransport):
    """Two POSIX shared-memory segments, filled alternately (same host only)."""

    def __init__(self, urls: Sequence[str], timeout: float = 120.0, api_key: str | None = None):
        super().__init__(urls, timeout, api_key)
        self._segments: dict[int, shared_memory.SharedMemory] = {}

    def buffer(self, slot: int, nbytes: int) -> memoryview:
        """Return the shared segment of ``slot``, created on first use."""
        seg = self._segments.get(slot)
        if seg is None or seg.size < nbytes:
            if seg is not None:
                seg.close()
                seg.unlink()
            seg = shared_memory.SharedMemory(create=True, size=nbytes)
            self._segments[slot] = seg
        return seg.buf

    def _source(self, slot: int, meta: BucketMeta) -> dict[str, Any]:
        return {"kind": "shm", "name": self._segments[slot].name}

    def close(self) -> None:
        """Unlink the segments and close the control channel."""
        super().close()
        for seg in self._segments.values():
            seg.close()
            seg.unlink()
        self._segments.clear()


@register_transport("disk")
class DiskTransport(HttpControlTransport):
    """Each bucket is written as a safetensors file the replicas read (the fallback).

    Args:
        urls: rollout server base URLs.
        directory: where bucket files go (default: a fresh temporary directory, removed on close).
    """

    def __init__(
        self,
        urls: Sequence[str],
        directory: str | os.PathLike[str] | None = None,
        timeout: float = 120.0,
        api_key: str | None = None,
    ):
        super().__init__(urls, timeout, api_key)
        self._own = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="polyrl-weights-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        self._buffers: dict[int, bytearray] = {}

    def buffer(self, slot: int, nbytes: int) -> memoryview:
        """Return an in-memory buffer for ``slot``; its bytes go to a file on send."""
        buf = self._buffers.get(slot)
        if buf is None or len(buf) < nbytes:
            buf = self._buffers[slot] = bytearray(nbytes)
        return memoryview(buf)

    def _path(self, meta: BucketMeta) -> Path:
        return self.directory / f"{meta.transfer_id}-{meta.index:05d}.safetensors"

    def _source(self, slot: int, meta: BucketMeta) -> dict[str, Any]:
        from safetensors.torch import save_file

        data = torch.frombuffer(self._buffers[slot], dtype=torch.uint8, count=meta.nbytes)
        path = self._path(meta)
        tmp = path.with_suffix(".tmp")
        save_file({"bucket": data}, str(tmp))
        os.replace(tmp, path)
        return {"kind": "disk", "path": str(path)}

    def _sent(self, slot: int, meta: BucketMeta) -> None:
        self._path(meta).unlink(missing_ok=True)

    def close(self) -> None:
        """Close the control channel; remove the directory if this transport made it."""
        super().close()
        if self._own:
            shutil.rmtree(self.directory, ignore_errors=True)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@register_transport("dist")
class DistTransport(HttpControlTransport):
    """Buckets broadcast over a gloo group spanning this sender (rank 0) and every replica.

    The group is created on the first transfer and reused; it is private (a
    ``ProcessGroupGloo`` over its own TCP store), so it coexists with the engine's default
    process group. Buckets are broadcast in index order; each replica issues its matching
    broadcasts in the same order (see :mod:`polyrl.weights.server_routes`).

    Args:
        urls: rollout server base URLs.
        host: address of the group's TCP store (this host).
        port: its port (0: a free one).
        timeout: seconds per control request and per collective.
        api_key: bearer token for the servers.
    """

    def __init__(
        self,
        urls: Sequence[str],
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 120.0,
        api_key: str | None = None,
    ):
        super().__init__(urls, timeout, api_key)
        self.host = host
        self.port = port
        self.timeout = timeout
        self._group: Any = None
        self._store: Any = None
        self._buffers: dict[int, torch.Tensor] = {}

    def _ensure_group(self) -> None:
        if self._group is not None:
            return
        import torch.distributed as dist

        port = self.port or _free_port(self.host)
        world = len(self.urls) + 1
        timeout = timedelta(seconds=self.timeout)
        self._store = dist.TCPStore(
            self.host, port, world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        futures = [
            self._pool.submit(
                self._post,
                url,
                "/weights/dist/init",
                {
                    "host": self.host,
                    "port": port,
                    "rank": i + 1,
                    "world_size": world,
                    "timeout": self.timeout,
                },
            )
            for i, url in enumerate(self.urls)
        ]
        self._group = dist.ProcessGroupGloo(self._store, 0, world, timeout)
        for f in futures:
            f.result()

    def begin(self, transfer_id: str, version: int) -> list[int]:
        """Create the group on first use, then start the transfer on every replica."""
        self._ensure_group()
        return super().begin(transfer_id, version)

    def buffer(self, slot: int, nbytes: int) -> memoryview:
        """Return the (pinnable) CPU buffer of ``slot``."""
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return memoryview(buf.numpy())

    def _source(self, slot: int, meta: BucketMeta) -> dict[str, Any]:
        return {"kind": "dist"}

    def send_bucket(self, slot: int, meta: BucketMeta) -> Callable[[], None]:
        """Announce the bucket over HTTP and broadcast its bytes; the callable waits for both."""
        body = {"meta": meta.to_dict(), "source": {"kind": "dist"}}
        futures = [self._pool.submit(self._post, u, "/weights/bucket", body) for u in self.urls]
        work = self._group.broadcast(self._buffers[slot][: meta.nbytes], 0)

        def wait() -> None:
            work.wait()
            for f in futures:
                f.result()

        return wait

    def close(self) -> None:
        """Drop the group and close the control channel."""
        super().close()
        self._group = None
        self._store = None


@register_transport("cuda_ipc")
class CudaIpcTransport(HttpControlTransport):
    """Two CUDA buffers shared with same-host replicas through CUDA IPC handles.

    UNTESTED: written for GPU machines; no GPU was available when it was written. Each bucket's
    IPC handle (``torch.multiprocessing`` reduction, pickled) goes over the control channel;
    the replica maps the buffer and copies the bucket out before answering.

    Args:
        urls: rollout server base URLs.
        device: the CUDA device holding the buffers.
        timeout: seconds per control request.
        api_key: bearer token for the servers.
    """

    def __init__(
        self,
        urls: Sequence[str],
        device: str = "cuda",
        timeout: float = 120.0,
        api_key: str | None = None,
    ):
        if not torch.cuda.is_available():
            raise WeightTransferError(
                "the cuda_ipc transport needs a CUDA device; none is available here "
                "(use shm, dist or disk)"
            )
        super().__init__(urls, timeout, api_key)
        self.device = torch.device(device)
        self._gpu: dict[int, torch.Tensor] = {}
        self._host: dict[int, torch.Tensor] = {}

    def buffer(self, slot: int, nbytes: int) -> memoryview:
        """Return a pinned host buffer for ``slot``; its bytes are copied to the GPU on send."""
        host = self._host.get(slot)
        if host is None or host.numel() < nbytes:
            host = self._host[slot] = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
            self._gpu[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return memoryview(host.numpy())

    def _source(self, slot: int, meta: BucketMeta) -> dict[str, Any]:
        import base64
        import pickle

        from torch.multiprocessing.reductions import reduce_tensor

        gpu = self._gpu[slot]
        gpu[: meta.nbytes].copy_(self._host[slot][: meta.nbytes])
        torch.cuda.current_stream(self.device).synchronize()
        handle = pickle.dumps(reduce_tensor(gpu))
        return {"kind": "cuda_ipc", "handle": base64.b64encode(handle).decode()}
