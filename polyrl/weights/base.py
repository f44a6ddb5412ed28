"""Weight-transfer interface: bucket metadata, checksums, errors and the transport registry.

A transfer moves ``(name, tensor)`` pairs from a model engine to rollout replicas in fixed-size
*buckets*: contiguous byte buffers holding several whole tensors back to back. Metadata (names,
shapes, dtypes, byte offsets, version, checksum) travels over a control channel (HTTP to the
rollout server); the bytes travel over a :class:`Transport`.
"""

from __future__ import annotations

import abc
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from polyrl.core import dtypes
from polyrl.core.errors import WeightTransferError
from polyrl.core.registry import Registry

__all__ = [
    "ALIGN",
    "CUDA_IPC_ENV",
    "TRANSPORTS",
    "BucketMeta",
    "TensorMeta",
    "align_up",
    "Transport",
    "WeightTransferError",
    "bucket_checksum",
    "create_transport",
    "dtype_from_name",
    "dtype_name",
    "register_transport",
    "registered_transports",
]

#: A rollout server accepts ``cuda_ipc`` buckets only with this variable set to ``1``: their
#: handles are pickles, i.e. code execution for whoever may POST to it (trusted senders only).
CUDA_IPC_ENV = "POLYRL_WEIGHTS_CUDA_IPC"


def dtype_name(dtype: torch.dtype) -> str:
    """Return the wire name of ``dtype`` (e.g. ``"float32"``)."""
    try:
        return dtypes.dtype_name(dtype)
    except ValueError as exc:
        raise WeightTransferError(str(exc)) from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name` (a name from bucket metadata)."""
    try:
        return dtypes.dtype_from_name(name)
    except ValueError as exc:
        raise WeightTransferError(f"bucket metadata: {exc}") from None


def bucket_checksum(data: memoryview | bytes | torch.Tensor) -> int:
    """CRC32 of a bucket's bytes (cheap enough to leave on in tests)."""
    if isinstance(data, torch.Tensor):
        data = memoryview(data.detach().to("cpu").contiguous().view(torch.uint8).numpy())
    return zlib.crc32(data) & 0xFFFFFFFF


#: Byte alignment of every tensor inside a bucket, so chunks can be viewed as any dtype.
ALIGN = 16


def align_up(n: int, align: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``align``."""
    return -(-n // align) * align


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives inside a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    start: int = 0

    @property
    def total_nbytes(self) -> int:
        """Size of the whole tensor (a chunk of a split tensor is smaller)."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=dtype_from_name(self.dtype)).element_size()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorMeta:
        """Parse the JSON form, rejecting malformed entries with a clear message."""
        try:
            return cls(
                name=str(data["name"]),
                shape=tuple(int(s) for s in data["shape"]),
                dtype=str(data["dtype"]),
                offset=int(data["offset"]),
                nbytes=int(data["nbytes"]),
                start=int(data.get("start", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightTransferError(
                f"malformed tensor metadata {dict(data)!r}: {exc}; expected name, shape, dtype, "
                "offset, nbytes"
            ) from exc


@dataclass(frozen=True)
class BucketMeta:
    """One bucket of a transfer: its tensors, size, index, version and optional checksum."""

    transfer_id: str
    version: int
    index: int
    nbytes: int
    tensors: tuple[TensorMeta, ...]
    checksum: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        # Built by hand: ``dataclasses.asdict`` deep-copies recursively and cost ~2 ms per
        # bucket of a few dozen tensors, on the sender's critical path between two packs.
        return {
            "transfer_id": self.transfer_id,
            "version": self.version,
            "index": self.index,
            "nbytes": self.nbytes,
            "tensors": [
                {
                    "name": t.name,
                    "shape": list(t.shape),
                    "dtype": t.dtype,
                    "offset": t.offset,
                    "nbytes": t.nbytes,
                    "start": t.start,
                }
                for t in self.tensors
            ],
            "checksum": self.checksum,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BucketMeta:
        """Parse the JSON form sent over the control channel."""
        try:
            return cls(
                transfer_id=str(data["transfer_id"]),
                version=int(data["version"]),
                index=int(data["index"]),
                nbytes=int(data["nbytes"]),
                tensors=tuple(TensorMeta.from_dict(t) for t in data["tensors"]),
                checksum=None if data.get("checksum") is None else int(data["checksum"]),
                extra=dict(data.get("extra") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightTransferError(
                f"malformed bucket metadata: {exc}; expected transfer_id, version, index, "
                "nbytes, tensors[, checksum, extra]"
            ) from exc


class Transport(abc.ABC):
    """Moves bucket bytes from the sender to every replica; one instance per sender.

    The sender calls :meth:`begin`, then :meth:`send_bucket` for each bucket (at most two
    in flight: the returned callable waits for one), then :meth:`commit` or :meth:`abort`.
    A transport is reusable across transfers (its buffers and process group are kept).
    """

    name: str = ""

    @abc.abstractmethod
    def begin(
        self, transfer_id: str, version: int, options: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Tell every replica a transfer at ``version`` starts; return their current versions.

        ``options`` go to each replica's receiver (``mode``, ``inflight``, ``stall_timeout``,
        ``measure_memory``; see :meth:`polyrl.weights.receiver.WeightReceiver.begin`).
        """

    @abc.abstractmethod
    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """Return a 1-D uint8 staging tensor of ``nbytes`` for buffer ``slot`` (0 or 1).

        The same memory is returned for a slot across buckets and transfers (no page faults
        after the first use); it may live on an accelerator (NCCL, CUDA IPC).
        """

    @abc.abstractmethod
    def send_bucket(self, slot: int, meta: BucketMeta) -> Callable[[], None]:
        """Start delivering buffer ``slot`` described by ``meta``; return a wait function."""

    def write_direct(
        self,
        name: str,
        flat: torch.Tensor,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        checksum: bool = False,
    ) -> bool:
        """Write tensor ``name`` straight into every replica's staging memory, if offered.

        ``flat`` is the tensor's flat view, ``dtype`` its wire dtype. Returns False (the
        default) when the transport or any replica cannot take it that way; the sender then
        packs it into buckets. Tensors written here are reported at :meth:`commit`.
        """
        return False

    def shared_mapped_bytes(self) -> int:
        """Bytes of the replicas' memory mapped into this process (direct writes), else 0.

        Those pages count in this process's resident set but belong to the replicas.
        """
        return 0

    @abc.abstractmethod
    def commit(self, transfer_id: str, version: int, buckets: int) -> list[int]:
        """Ask every replica to switch atomically after ``buckets``; return their versions."""

    @abc.abstractmethod
    def abort(self, transfer_id: str) -> None:
        """Ask every replica to drop the staged tensors of ``transfer_id``."""

    def close(self) -> None:  # noqa: B027 - optional hook, most transports hold nothing
        """Release transport resources."""


#: Transport classes by name; the built-in ones are in :mod:`polyrl.weights.transports`.
TRANSPORTS: Registry[type[Transport]] = Registry(
    "weight transport",
    lazy=dict.fromkeys(("shm", "disk", "dist", "cuda_ipc"), "polyrl.weights.transports"),
    base=Transport,
    name_attr="name",
)
register_transport = TRANSPORTS.register
registered_transports = TRANSPORTS.names


def create_transport(name: str, **options: Any) -> Transport:
    """Instantiate the transport registered as ``name``."""
    return TRANSPORTS.get(name)(**options)
