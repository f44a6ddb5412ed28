"""Built-in transports: ``shm``, ``dist`` (gloo or NCCL broadcast), ``disk``, ``cuda_ipc``.

All use HTTP to the rollout servers as control channel (routes in
:mod:`polyrl.weights.server_routes`, one persistent keep-alive connection per replica and one
small JSON message per bucket); each bucket is posted to every replica concurrently and the
sender only reuses a buffer once all replicas answered for it. Every transport keeps its two
bucket buffers (and its process group) across transfers: reuse one transport per sender.

``cuda_ipc`` and the NCCL flavour of ``dist`` are written for GPU machines and are
**untested on GPU** (their device naming, routing and group lifetime are tested on CPU).
"""

from __future__ import annotations

import abc
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import httpx
import torch

from polyrl.core.arena import ArenaWriter
from polyrl.core.cuda import export_cuda_tensor, indexed_device
from polyrl.core.process import free_port
from polyrl.weights.base import (
    BucketMeta,
    Transport,
    WeightTransferError,
    dtype_name,
    register_transport,
)

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
        # A client is made per transfer, and loading the CA bundle takes 20-35 ms of it: load it
        # only if some replica is reached over TLS (redirects are not followed).
        tls = any(u.lower().startswith("https://") for u in self.urls)
        self._http = httpx.Client(timeout=timeout, headers=headers, verify=tls)
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(self.urls)))
        #: Transfers begun through this transport (a sender keeps one for the run).
        self.transfers = 0
        self.received: list[dict[str, int]] = []

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

    def begin(
        self, transfer_id: str, version: int, options: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Start the transfer on every replica; return their serving versions."""
        answers = self._begin_all(transfer_id, version, options)
        return [int(a["weight_version"]) for a in answers]

    def _begin_all(
        self, transfer_id: str, version: int, options: Mapping[str, Any] | None, **extra: Any
    ) -> list[dict[str, Any]]:
        """POST ``/weights/begin`` (with ``extra`` fields) to every replica; their answers."""
        body = {**(options or {}), **extra, "transfer_id": transfer_id, "version": version}
        self.transfers += 1
        return self._all("/weights/begin", body)

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
        body.update(self._commit_extra())
        answers = self._all("/weights/commit", body)
        #: What each replica says it received in the last transfer: buckets by source kind.
        self.received = [dict(a.get("received") or {}) for a in answers]
        return [int(a["weight_version"]) for a in answers]

    def _commit_extra(self) -> dict[str, Any]:
        """More fields for the commit message (e.g. the tensors written directly)."""
        return {}

    def abort(self, transfer_id: str) -> None:
        """Drop the staging on every replica."""
        self._all("/weights/abort", {"transfer_id": transfer_id})

    def close(self) -> None:
        """Close the HTTP client and the worker threads."""
        self._pool.shutdown(wait=True)
        self._http.close()


@register_transport("shm")
class ShmTransport(HttpControlTransport):
    """Same-host transfers through shared memory.

    Direct writes (default): a staged transfer to replicas whose shadows can live in shared
    memory (the native engine on CPU) asks each for its arena at ``begin`` and writes every
    tensor straight into its shadow (:mod:`polyrl.core.arena`): one copy of each byte instead
    of two, and no bucket. Anything a replica does not offer (an ``inplace``
    transfer, weights on a GPU, another backend, a renaming ``name_map``, a dtype or shape the
    replica does not have) goes through two POSIX shared-memory bucket segments filled
    alternately, which every replica copies out of.

    Args:
        urls: rollout server base URLs.
        timeout: seconds per control request.
        api_key: bearer token for the servers.
        direct: ask replicas for direct writes (``False``: buckets only).
    """

    def __init__(
        self,
        urls: Sequence[str],
        timeout: float = 120.0,
        api_key: str | None = None,
        direct: bool = True,
    ):
        super().__init__(urls, timeout, api_key)
        self.direct = direct
        self._segments: dict[int, shared_memory.SharedMemory] = {}
        self._views: dict[int, torch.Tensor] = {}
        # Open arenas by path (kept across transfers) and, for the transfer in progress, each
        # replica's (writer, offered tensors), and what was written directly: name -> CRC32.
        self._writers: dict[str, ArenaWriter] = {}
        self._offers: list[tuple[ArenaWriter, dict[str, list[Any]]]] | None = None
        self._written: dict[str, int | None] = {}

    def begin(
        self, transfer_id: str, version: int, options: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Start the transfer; with ``direct``, open the arenas the replicas offer."""
        extra = {"direct": True} if self.direct else {}
        answers = self._begin_all(transfer_id, version, options, **extra)
        self._written = {}
        self._offers = None
        offered = [a.get("direct") for a in answers]
        for path in [p for p, w in self._writers.items() if w.stale]:
            self._writers.pop(path).close()  # arenas their replica has released
        if self.direct and offered and all(offered):
            try:
                offers = []
                for offer in offered:
                    path = str(offer["path"])
                    writer = self._writers.pop(path, None) or ArenaWriter(path)
                    self._writers[path] = writer  # most recently offered last
                    offers.append((writer, dict(offer["tensors"])))
                self._offers = offers
            except (WeightTransferError, KeyError, TypeError):  # another host's /dev/shm
                self._offers = None
        # A replica alternates two arenas (live and shadow): keep both mapped, no more.
        keep = 2 * len(self.urls)
        while len(self._writers) > keep:
            self._writers.pop(next(iter(self._writers))).close()
        return [int(a["weight_version"]) for a in answers]

    def write_direct(
        self,
        name: str,
        flat: torch.Tensor,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        checksum: bool = False,
    ) -> bool:
        """Copy tensor ``name`` into every replica's arena if all of them offer it."""
        if not self._offers:
            return False
        wire = dtype_name(dtype)
        targets = []
        for writer, tensors in self._offers:
            entry = tensors.get(name)
            if entry is None or tuple(entry[1]) != tuple(shape) or entry[2] != wire:
                return False
            targets.append((writer, int(entry[0])))
        if len(targets) == 1:
            crcs = [targets[0][0].write(targets[0][1], flat, dtype, checksum)]
        else:  # one thread per replica (the copies release the GIL)
            futures = [self._pool.submit(w.write, off, flat, dtype, checksum) for w, off in targets]
            crcs = [f.result() for f in futures]
        self._written[name] = crcs[0]
        return True

    def _commit_extra(self) -> dict[str, Any]:
        return {"direct": self._written} if self._written else {}

    def shared_mapped_bytes(self) -> int:
        """Bytes of the replicas' arenas mapped here (their shadows; not this process's)."""
        return sum(w.nbytes for w in self._writers.values())

    def abort(self, transfer_id: str) -> None:
        """Drop the staging on every replica."""
        self._written = {}
        super().abort(transfer_id)

    def _drop(self, slot: int) -> None:
        self._views.pop(slot, None)  # the tensor exports the buffer: release it before close
        seg = self._segments.pop(slot, None)
        if seg is not None:
            seg.close()
            seg.unlink()

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """Return the shared segment of ``slot`` as a tensor, created on first use."""
        seg = self._segments.get(slot)
        if seg is None or seg.size < nbytes:
            self._drop(slot)
            seg = shared_memory.SharedMemory(create=True, size=nbytes)
            self._segments[slot] = seg
            self._views[slot] = torch.frombuffer(seg.buf, dtype=torch.uint8, count=seg.size)
        return self._views[slot][:nbytes]

    def _source(self, slot: int, meta: BucketMeta) -> dict[str, Any]:
        return {"kind": "shm", "name": self._segments[slot].name}

    def close(self) -> None:
        """Unlink the segments, close the arenas and the control channel."""
        super().close()
        for slot in list(self._segments):
            self._drop(slot)
        for writer in self._writers.values():
            writer.close()
        self._writers = {}


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
        self._buffers: dict[int, torch.Tensor] = {}

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """Return the in-memory buffer of ``slot``; its bytes go to a file on send."""
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]

    def _path(self, meta: BucketMeta) -> Path:
        return self.directory / bucket_file_name(meta.transfer_id, meta.index)

    def _source(self, slot: int, meta: BucketMeta) -> dict[str, Any]:
        path = self._path(meta)
        tmp = path.with_suffix(".tmp")
        write_bucket_file(tmp, self._buffers[slot][: meta.nbytes])
        os.replace(tmp, path)
        return {"kind": "disk", "path": str(path)}

    def _sent(self, slot: int, meta: BucketMeta) -> None:
        self._path(meta).unlink(missing_ok=True)

    def close(self) -> None:
        """Close the control channel; remove the directory if this transport made it."""
        super().close()
        if self._own:
            shutil.rmtree(self.directory, ignore_errors=True)


def write_bucket_file(path: str | os.PathLike[str], data: torch.Tensor) -> None:
    """Write ``data`` (1-D uint8, CPU) as a safetensors file with one tensor ``bucket``.

    Written by hand (the format is an 8-byte header length, a JSON header, the bytes) so the
    bucket goes from its buffer to the file with no serialised copy in memory.
    """
    n = int(data.numel())
    header = json.dumps({"bucket": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}})
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        if n:
            f.write(memoryview(data.contiguous().numpy()))


def bucket_file_name(transfer_id: str, index: int) -> str:
    """Name of the file the disk transport writes bucket ``index`` of a transfer to."""
    return f"{transfer_id}-{index:05d}.safetensors"


def read_bucket_file(path: str | os.PathLike[str], into: Callable[[int], torch.Tensor]):
    """Read the bucket of a file written by :func:`write_bucket_file` (or safetensors).

    ``into(nbytes)`` returns the (reused) uint8 tensor to read into; returns it filled.

    Raises:
        WeightTransferError: the file is not such a bucket file (or is truncated).
    """
    with open(path, "rb") as f:
        total = os.fstat(f.fileno()).st_size
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 <= size <= total - 8:
            raise WeightTransferError(
                f"{path}: not a bucket file (its first 8 bytes do not give the length of a "
                f"header that fits in its {total} bytes)"
            )
        try:
            header = json.loads(f.read(size))
        except ValueError as exc:
            raise WeightTransferError(f"{path}: not a bucket file (bad header: {exc})") from None
        if not isinstance(header, dict):
            raise WeightTransferError(f"{path}: not a bucket file (its header is not an object)")
        entry = header.get("bucket")
        if not entry or entry.get("dtype") != "U8":
            raise WeightTransferError(
                f"{path}: expected one uint8 tensor 'bucket', found {sorted(header)}"
            )
        begin, end = (int(x) for x in entry["data_offsets"])
        out = into(end - begin)
        f.seek(8 + size + begin)
        got = f.readinto(memoryview(out.numpy())) if end > begin else 0
        if got != end - begin:
            raise WeightTransferError(f"{path}: truncated, {got} of {end - begin} bytes")
    return out


def group_device(backend: str, device: str | torch.device | None) -> torch.device:
    """Return the device a ``dist`` group's buffers live on: indexed CUDA for NCCL, else CPU.

    Sender and replica both call this: ``None`` or ``"cuda"`` is the process's current GPU.
    """
    return indexed_device(device) if backend == "nccl" else torch.device("cpu")


def make_group(
    backend: str, store: Any, rank: int, world: int, timeout: timedelta, device: str | None
) -> Any:
    """Create a private process group over ``store`` (gloo on CPU, NCCL on ``device``)."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    if backend == "nccl":
        # Untested on GPU: a private NCCL communicator on the given CUDA device.
        if not dist.is_nccl_available() or not torch.cuda.is_available():
            raise WeightTransferError(
                "the dist transport with backend='nccl' needs CUDA and NCCL; neither is "
                "available here (use backend='gloo')"
            )
        # set_device refuses an unindexed "cuda"; the current device is what "cuda" meant.
        torch.cuda.set_device(group_device(backend, device))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    raise WeightTransferError(f"unknown dist backend {backend!r}; expected 'gloo' or 'nccl'")


@register_transport("dist")
class DistTransport(HttpControlTransport):
    """Buckets broadcast over a group spanning this sender (rank 0) and every replica.

    The group is created on the first transfer and reused; it is private (a
    ``ProcessGroupGloo``, or ``ProcessGroupNCCL`` with ``backend="nccl"``, over its own TCP
    store), so it coexists with the engine's default process group. Buckets are broadcast in
    index order; each replica issues its matching broadcasts in the same order into two reused
    receive buffers (see :mod:`polyrl.weights.server_routes`).

    Args:
        urls: rollout server base URLs.
        host: address of the group's TCP store (this host).
        port: its port (0: a free one).
        timeout: seconds per control request and per collective.
        api_key: bearer token for the servers.
        backend: ``gloo`` (CPU buffers) or ``nccl`` (GPU buffers; untested, no GPU lent).
        device: the CUDA device of the buffers with NCCL (default: the current one; replicas
            use their own).
    """

    def __init__(
        self,
        urls: Sequence[str],
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 120.0,
        api_key: str | None = None,
        backend: str = "gloo",
        device: str | None = None,
    ):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"dist backend must be 'gloo' or 'nccl', got {backend!r}")
        super().__init__(urls, timeout, api_key)
        self.host = host
        self.port = port
        self.timeout = timeout
        self.backend = backend
        # Indexed, so the buffers, set_device and the group agree on one GPU.
        self.device = group_device(backend, device)
        self._group: Any = None
        self._store: Any = None
        self._buffers: dict[int, torch.Tensor] = {}

    def _ensure_group(self) -> None:
        if self._group is not None:
            return
        import torch.distributed as dist

        port = self.port or free_port(self.host)
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
                    "backend": self.backend,
                },
            )
            for i, url in enumerate(self.urls)
        ]
        try:
            self._group = make_group(self.backend, self._store, 0, world, timeout, str(self.device))
        finally:
            for f in futures:
                f.result()

    def begin(
        self, transfer_id: str, version: int, options: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Create the group on first use, then start the transfer on every replica."""
        self._ensure_group()
        return super().begin(transfer_id, version, options)

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """Return the buffer of ``slot`` (CPU for gloo, the CUDA device for NCCL)."""
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

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
        """Shut the group down and close the control channel."""
        super().close()
        group, self._group = self._group, None
        if group is not None:
            # Dropping it is not enough: an NCCL communicator holds GPU memory and threads
            # until it is shut down.
            group.shutdown()
        self._store = None
        self._buffers.clear()


@register_transport("cuda_ipc")
class CudaIpcTransport(HttpControlTransport):
    """Two CUDA buffers shared with same-host replicas through CUDA IPC handles.

    Untested on GPU (its routing and handles are tested on CPU). The sender
    packs straight into two GPU buffers (casts happen on the device); each bucket's IPC handle
    (``torch.multiprocessing`` reduction, pickled) goes over the control channel; the replica
    maps the buffer and copies the bucket into its destinations (device to device when the
    replica serves on a GPU) before answering.

    Args:
        urls: rollout server base URLs.
        device: the CUDA device holding the buffers (default: the current one).
        timeout: seconds per control request.
        api_key: bearer token for the servers.
    """

    def __init__(
        self,
        urls: Sequence[str],
        device: str | None = None,
        timeout: float = 120.0,
        api_key: str | None = None,
    ):
        if not torch.cuda.is_available():
            raise WeightTransferError(
                "the cuda_ipc transport needs a CUDA device; none is available here "
                "(use shm, dist or disk)"
            )
        super().__init__(urls, timeout, api_key)
        self.device = indexed_device(device)
        self._gpu: dict[int, torch.Tensor] = {}
        self._handles: dict[int, dict[str, str]] = {}

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """Return the GPU buffer of ``slot`` (allocated once; its IPC handle is cached)."""
        gpu = self._gpu.get(slot)
        if gpu is None or gpu.numel() < nbytes:
            gpu = self._gpu[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._handles.pop(slot, None)
        return gpu[:nbytes]

    def _source(self, slot: int, meta: BucketMeta) -> dict[str, Any]:
        # The packing copies run on this stream: the replica must see them finished.
        torch.cuda.current_stream(self.device).synchronize()
        if slot not in self._handles:
            # With the GPU's UUID: a replica with its own CUDA_VISIBLE_DEVICES numbers it
            # differently than this process does.
            self._handles[slot] = export_cuda_tensor(self._gpu[slot])
        return {"kind": "cuda_ipc", **self._handles[slot]}

    def close(self) -> None:
        """Free the two GPU buffers and close the control channel."""
        super().close()
        self._handles.clear()
        self._gpu.clear()
