"""Rollout-server side of a weight transfer: copy buckets into place, switch atomically.

Each chunk of a bucket is copied **once**, straight from the transport's memory into the
tensor a :class:`WeightTarget` names as its destination:

* ``staged`` (default, atomic): the destination is a reusable *shadow* of the parameter; the
  serving weights are untouched until :meth:`WeightReceiver.commit`, where the target swaps
  the shadows in (pointers, no copy). Extra memory: one model (kept across updates) plus the
  transport's ~2 buckets. A transfer that is aborted, superseded, stalled or never committed
  leaves the old version serving.
* ``inplace`` (bounded): the target pauses and hands out its live parameters; extra memory is
  the transport's ~2 buckets. A transfer that does not commit leaves the weights mixed, so the
  target refuses requests (HTTP 503 with the reason) until a later transfer commits.

With a ``name_map`` hook (backends whose names differ, e.g. fused qkv) each tensor is first
assembled in a temporary of its own size, then mapped and copied into the destinations.
"""

from __future__ import annotations

import abc
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from polyrl.weights.base import (
    BucketMeta,
    WeightTransferError,
    bucket_checksum,
    dtype_from_name,
)
from polyrl.weights.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

__all__ = [
    "MODES",
    "POLICIES",
    "LoadFn",
    "LoadFnTarget",
    "NameMap",
    "WeightReceiver",
    "WeightTarget",
]

#: Receiver staging modes.
MODES = ("staged", "inplace")
#: What happens to in-flight requests during a transfer.
POLICIES = ("keep", "pause", "abort")

#: ``load_fn(named_tensors, version) -> new_version``: a backend's atomic switch.
LoadFn = Callable[[list[tuple[str, torch.Tensor]], int], int]
#: Maps one sender name to the backend's ``(name, tensor)`` pairs (e.g. fusing q/k/v).
NameMap = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


class WeightTarget(abc.ABC):
    """The serving side of a transfer: where tensors go and how the switch happens."""

    @abc.abstractmethod
    def current_version(self) -> int:
        """Return the weight version now serving."""

    @abc.abstractmethod
    def begin(self, transfer_id: str, mode: str, inflight: str) -> None:
        """Prepare transfer ``transfer_id`` (apply the in-flight policy; pause for inplace)."""

    @abc.abstractmethod
    def destination(
        self, transfer_id: str, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """Return the contiguous tensor that receives ``name`` (errors name the tensor)."""

    @abc.abstractmethod
    def commit(self, transfer_id: str, names: Sequence[str], version: int) -> int:
        """Switch to the received tensors ``names``; ``version < 0``: current + 1."""

    @abc.abstractmethod
    def abort(self, transfer_id: str, reason: str) -> None:
        """Drop transfer ``transfer_id``."""

    def held_bytes(self) -> int:
        """Bytes the target holds for transfers (e.g. shadows); 0 if none."""
        return 0

    def tensor_done(self, transfer_id: str, name: str) -> None:  # noqa: B027 - optional hook
        """React to tensor ``name`` being complete (e.g. release a mapping of it)."""

    def shared_layout(self, transfer_id: str) -> dict[str, Any] | None:
        """Offer the destinations as a shared arena a same-host sender writes into directly.

        ``{"path", "size", "tensors": {name: [offset, shape, dtype]}}``, or ``None`` (the
        default) where the target cannot: the sender then sends every tensor in buckets.
        """
        return None


class LoadFnTarget(WeightTarget):
    """Adapter for backends that only have an atomic ``load_fn(pairs, version)``.

    Tensors are received into temporaries (a full model copy per transfer) and handed over
    at commit; ``inplace`` is treated as ``staged``.
    """

    def __init__(self, load_fn: LoadFn, current_version: Callable[[], int]):
        self.load_fn = load_fn
        self._current = current_version
        self._staged: dict[str, torch.Tensor] = {}
        self._transfer: str | None = None

    def current_version(self) -> int:
        """Return the backend's version."""
        return int(self._current())

    def begin(self, transfer_id: str, mode: str, inflight: str) -> None:
        """Start collecting a new set of tensors."""
        self._staged = {}
        self._transfer = transfer_id

    def destination(
        self, transfer_id: str, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """Allocate a temporary for ``name``."""
        if transfer_id != self._transfer:
            raise WeightTransferError(f"transfer {transfer_id} is not in progress")
        buf = self._staged.get(name)
        if buf is None:
            buf = self._staged[name] = torch.empty(shape, dtype=dtype)
        return buf

    def commit(self, transfer_id: str, names: Sequence[str], version: int) -> int:
        """Hand the collected tensors to ``load_fn``."""
        staged, self._staged, self._transfer = self._staged, {}, None
        return self.load_fn([(n, staged[n]) for n in names], version)

    def abort(self, transfer_id: str, reason: str) -> None:
        """Drop the temporaries."""
        if transfer_id == self._transfer:
            self._staged, self._transfer = {}, None

    def held_bytes(self) -> int:
        """Bytes of temporaries held."""
        return sum(t.numel() * t.element_size() for t in self._staged.values())


#: Placeholder destination of a tensor already complete.
_DONE = torch.empty(0)


@dataclass
class _Slot:
    """One tensor of the transfer being received."""

    dest: torch.Tensor
    total: int
    shape: tuple[int, ...]
    filled: int = 0
    temporary: bool = False


class WeightReceiver:
    """Receives the buckets of one transfer at a time into a :class:`WeightTarget`.

    Args:
        target: where tensors go and how the switch happens.
        name_map: optional hook renaming/reshaping whole tensors before they reach the target.
        stall_timeout: seconds without a bucket after which a transfer is aborted (a killed
            sender sends no abort); a ``begin`` may override it.
    """

    def __init__(
        self,
        target: WeightTarget,
        name_map: NameMap | None = None,
        stall_timeout: float = 120.0,
    ):
        self.target = target
        self.name_map = name_map
        self.stall_timeout = stall_timeout
        self._lock = threading.RLock()
        self._transfer: str | None = None
        self._version = -1
        self._mode = "staged"
        self._slots: dict[str, _Slot] = {}
        self._done: list[str] = []
        # Names the target offered for direct writes in this transfer: name -> (shape, dtype).
        self._direct: dict[str, tuple[tuple[int, ...], str]] = {}
        self._seen: set[int] = set()
        self._bytes = 0
        self._t0 = 0.0
        self._last = 0.0
        self._stop: threading.Event | None = None
        self._scratch: dict[int, torch.Tensor] = {}
        self._temp_bytes = 0
        self._peak_extra = 0
        self._measure = False
        self._rss0: int | None = None
        self.last: dict[str, Any] = {}
        #: Called with the transfer id after every abort (e.g. to release transport resources).
        self.on_abort: Callable[[str], None] | None = None

    # ------------------------------------------------------------------------- helpers

    def current_version(self) -> int:
        """Return the version now serving."""
        return self.target.current_version()

    def status(self) -> dict[str, Any]:
        """Report the transfer in progress (if any), and the last finished one."""
        with self._lock:
            return {
                "transfer_id": self._transfer,
                "version": self._version,
                "mode": self._mode,
                "buckets": len(self._seen),
                "bytes": self._bytes,
                "weight_version": self.current_version(),
                "scratch_bytes": self._scratch_bytes(),
                "held_bytes": self.target.held_bytes(),
                "last": dict(self.last),
            }

    def _scratch_bytes(self) -> int:
        return sum(t.numel() for t in self._scratch.values())

    def _track(self) -> None:
        self._peak_extra = max(self._peak_extra, self._scratch_bytes() + self._temp_bytes)

    def scratch(self, slot: int, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Return reusable receive memory for ``slot`` (transports that must copy bytes in).

        Two slots (double buffering) bound a replica's receive memory by two buckets.
        """
        buf = self._scratch.get(slot)
        if buf is None or buf.numel() < nbytes or buf.device != torch.device(device):
            self._scratch.pop(slot, None)
            buf = self._scratch[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._track()
        return buf[:nbytes]

    def _reset(self) -> None:
        if self._stop is not None:
            self._stop.set()
        self._stop = None
        self._transfer = None
        self._version = -1
        self._slots = {}
        self._done = []
        self._direct = {}
        self._seen = set()
        self._temp_bytes = 0

    def _finish_stats(self, transfer_id: str, outcome: str) -> None:
        peak = peak_rss_bytes() if self._measure else None
        self.last = {
            "transfer_id": transfer_id,
            "outcome": outcome,
            "mode": self._mode,
            "buckets": len(self._seen),
            "bytes": self._bytes,
            "seconds": round(time.perf_counter() - self._t0, 6),
            "peak_extra_bytes": self._peak_extra,
            "rss_peak_delta": None
            if peak is None or self._rss0 is None
            else max(0, peak - self._rss0),
        }

    # -------------------------------------------------------------------------- protocol

    def begin(
        self,
        transfer_id: str,
        version: int,
        mode: str = "staged",
        inflight: str = "keep",
        stall_timeout: float | None = None,
        measure_memory: bool = False,
    ) -> int:
        """Start a transfer (aborting any unfinished one); return the version now serving.

        Args:
            transfer_id: the transfer's id.
            version: the version it will switch to; ``< 0``: decided at commit (current + 1).
            mode: ``staged`` (atomic) or ``inplace`` (bounded memory); see the module doc.
            inflight: ``keep``, ``pause`` or ``abort`` in-flight requests during the transfer.
            stall_timeout: seconds without a bucket before the transfer is aborted.
            measure_memory: reset the peak RSS now and report the transfer's peak in
                ``status()["last"]["rss_peak_delta"]``.
        """
        if mode not in MODES:
            raise WeightTransferError(f"unknown staging mode {mode!r}; expected one of {MODES}")
        if inflight not in POLICIES:
            raise WeightTransferError(
                f"unknown in-flight policy {inflight!r}; expected one of {POLICIES}"
            )
        current = self.current_version()
        if version >= 0 and version <= current:
            raise WeightTransferError(
                f"transfer {transfer_id} announces weight version {version}, but version "
                f"{current} is already serving; expected a version > {current}"
            )
        with self._lock:
            if self._transfer is not None:
                self._abort_locked(self._transfer, f"superseded by transfer {transfer_id}")
            self.target.begin(transfer_id, mode, inflight)
            self._transfer = transfer_id
            self._version = version
            self._mode = mode
            self._bytes = 0
            self._peak_extra = 0
            self._measure = measure_memory
            self._rss0 = None
            if measure_memory and reset_peak_rss():
                self._rss0 = rss_bytes()
            self._t0 = self._last = time.perf_counter()
            timeout = self.stall_timeout if stall_timeout is None else float(stall_timeout)
            self._stop = threading.Event()
            if timeout > 0:
                threading.Thread(
                    target=self._watch,
                    args=(transfer_id, timeout, self._stop),
                    name="polyrl-weights-watchdog",
                    daemon=True,
                ).start()
        return current

    def offer_direct(self, transfer_id: str) -> dict[str, Any] | None:
        """Return the target's shared arena for ``transfer_id``, or ``None``.

        See :meth:`WeightTarget.shared_layout` for its form.
        Only staged transfers without a ``name_map`` are offered: the arena holds shadows,
        which keep the switch atomic, and a sender writing directly cannot rename tensors.
        """
        with self._lock:
            self._check(transfer_id)
            if self._mode != "staged" or self.name_map is not None:
                return None
            layout = self.target.shared_layout(transfer_id)
            if layout is not None:
                self._direct = {
                    str(name): (tuple(int(d) for d in entry[1]), str(entry[2]))
                    for name, entry in layout["tensors"].items()
                }
            return layout

    def _accept_direct(self, transfer_id: str, direct: dict[str, int | None]) -> str | None:
        """Count tensors the sender wrote into the offered arena; return a problem, if any."""
        for name, crc in direct.items():
            offered = self._direct.get(name)
            if offered is None:
                return (
                    f"tensor {name!r} was reported as written directly, but this replica did "
                    f"not offer it in transfer {transfer_id} (offered: {len(self._direct)} names)"
                )
            if name in self._slots:
                return (
                    f"tensor {name!r} arrived twice in transfer {transfer_id} (in a bucket and "
                    "written directly)"
                )
            shape, dtype = offered
            if crc is not None:
                dest = self.target.destination(transfer_id, name, shape, dtype_from_name(dtype))
                got = bucket_checksum(dest.reshape(-1).view(torch.uint8))
                if got != int(crc):
                    return (
                        f"checksum mismatch in tensor {name!r} written directly: got "
                        f"{got:#010x}, expected {int(crc):#010x}"
                    )
            self._done.append(name)
            self._bytes += math.prod(shape) * dtype_from_name(dtype).itemsize
        return None

    def _watch(self, transfer_id: str, timeout: float, stop: threading.Event) -> None:
        # A killed sender sends no abort: give up after `timeout` seconds without progress.
        while not stop.wait(max(0.05, timeout - (time.perf_counter() - self._last))):
            if time.perf_counter() - self._last >= timeout:
                self.abort(transfer_id, f"no bucket or commit for {timeout:g} s; sender gone?")
                return

    def _check(self, transfer_id: str) -> None:
        if self._transfer != transfer_id:
            raise WeightTransferError(
                f"transfer {transfer_id} is not in progress here (current: {self._transfer}); "
                "it was aborted, superseded or timed out, start again with begin"
            )

    def _slot(self, transfer_id: str, name: str, shape: tuple[int, ...], dtype: torch.dtype):
        slot = self._slots.get(name)
        if slot is not None:
            if slot.shape != shape:
                raise WeightTransferError(f"tensor {name!r} arrives with two different shapes")
            return slot
        total = 1
        for d in shape:
            total *= d
        total *= torch.empty((), dtype=dtype).element_size()
        if self.name_map is not None:
            dest = torch.empty(shape, dtype=dtype)
            self._temp_bytes += total
            self._track()
            slot = _Slot(dest, total, shape, temporary=True)
        else:
            dest = self.target.destination(transfer_id, name, shape, dtype)
            if tuple(dest.shape) != shape:
                raise WeightTransferError(
                    f"tensor {name!r} has shape {list(shape)}, the serving model expects "
                    f"{list(dest.shape)}"
                )
            if not dest.is_contiguous():
                raise WeightTransferError(f"the destination of tensor {name!r} is not contiguous")
            slot = _Slot(dest, total, shape)
        self._slots[name] = slot
        return slot

    def _complete(self, transfer_id: str, name: str, slot: _Slot) -> None:
        if not slot.temporary:
            self._done.append(name)
            slot.dest = _DONE  # drop this view of the destination (a mapped file, say)
            self.target.tensor_done(transfer_id, name)
            return
        assert self.name_map is not None
        for mapped, tensor in self.name_map(name, slot.dest):
            dest = self.target.destination(transfer_id, mapped, tuple(tensor.shape), tensor.dtype)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise WeightTransferError(
                    f"tensor {mapped!r} (mapped from {name!r}) has shape {list(tensor.shape)}, "
                    f"the serving model expects {list(dest.shape)}"
                )
            dest.copy_(tensor)
            del dest
            self._done.append(mapped)
            self.target.tensor_done(transfer_id, mapped)
        self._temp_bytes -= slot.total
        slot.dest = torch.empty(0)  # free the temporary now, not at the end of the transfer

    def receive(self, meta: BucketMeta, data: memoryview | torch.Tensor) -> None:
        """Copy the tensors of one bucket from ``data`` (bytes or a uint8 tensor) into place."""
        with self._lock:
            self._check(meta.transfer_id)
            self._last = time.perf_counter()
            if meta.index in self._seen or meta.index < 0:
                raise WeightTransferError(
                    f"bucket {meta.index} of transfer {meta.transfer_id} arrived twice or has a "
                    "negative index"
                )
            size = data.numel() if isinstance(data, torch.Tensor) else len(data)
            if size < meta.nbytes:
                raise WeightTransferError(
                    f"bucket {meta.index} holds {size} bytes, its metadata says {meta.nbytes}"
                )
            if isinstance(data, torch.Tensor):
                raw = data.reshape(-1)[: meta.nbytes]
            elif meta.nbytes:
                raw = torch.frombuffer(data, dtype=torch.uint8, count=meta.nbytes)
            else:
                raw = torch.empty(0, dtype=torch.uint8)
            if meta.checksum is not None:
                got = bucket_checksum(raw)
                if got != meta.checksum:
                    names = [t.name for t in meta.tensors]
                    raise WeightTransferError(
                        f"checksum mismatch in bucket {meta.index} (tensors {names}): "
                        f"got {got:#010x}, expected {meta.checksum:#010x}"
                    )
            for t in meta.tensors:
                if t.offset < 0 or t.offset + t.nbytes > meta.nbytes:
                    raise WeightTransferError(
                        f"tensor {t.name!r} spans bytes [{t.offset}, {t.offset + t.nbytes}) "
                        f"outside bucket {meta.index} of {meta.nbytes} bytes"
                    )
                wire = dtype_from_name(t.dtype)
                slot = self._slot(meta.transfer_id, t.name, t.shape, wire)
                if t.start < 0 or t.start + t.nbytes > slot.total:
                    raise WeightTransferError(
                        f"tensor {t.name!r} of shape {list(t.shape)} {t.dtype} is "
                        f"{slot.total} bytes; a chunk reaches byte {t.start + t.nbytes}"
                    )
                if t.nbytes and slot.filled + t.nbytes > slot.total:
                    raise WeightTransferError(
                        f"tensor {t.name!r} receives more than its {slot.total} bytes "
                        "(a chunk arrived twice)"
                    )
                if t.nbytes:
                    self._copy(t.name, slot.dest, wire, raw, t.offset, t.start, t.nbytes)
                slot.filled += t.nbytes
                if slot.filled == slot.total:
                    self._complete(meta.transfer_id, t.name, slot)
            self._seen.add(meta.index)
            self._bytes += meta.nbytes
            self._last = time.perf_counter()

    @staticmethod
    def _copy(
        name: str,
        dest: torch.Tensor,
        wire: torch.dtype,
        raw: torch.Tensor,
        offset: int,
        start: int,
        nbytes: int,
    ) -> None:
        src = raw[offset : offset + nbytes]
        if dest.dtype == wire:
            dest.reshape(-1).view(torch.uint8)[start : start + nbytes].copy_(src)
            return
        # Different dtypes (e.g. bf16 on the wire into fp32 parameters): convert while copying,
        # which needs whole, aligned elements (the sender aligns every chunk).
        size = torch.empty((), dtype=wire).element_size()
        if offset % size or start % size or nbytes % size:
            raise WeightTransferError(
                f"tensor {name!r}: a chunk at byte {start} of {nbytes} bytes is not aligned to "
                f"its {wire} elements, so it cannot be converted to {dest.dtype}"
            )
        dest.reshape(-1)[start // size : (start + nbytes) // size].copy_(src.view(wire))

    def _abort_locked(self, transfer_id: str, reason: str) -> None:
        self._finish_stats(transfer_id, f"aborted: {reason}")
        self._reset()
        self.target.abort(transfer_id, reason)
        if self.on_abort is not None:
            self.on_abort(transfer_id)

    def abort(self, transfer_id: str | None = None, reason: str = "aborted by the sender") -> bool:
        """Drop transfer ``transfer_id`` (or any); True if one was in progress."""
        with self._lock:
            if self._transfer is None or (transfer_id and transfer_id != self._transfer):
                return False
            self._abort_locked(self._transfer, reason)
            return True

    def commit(
        self,
        transfer_id: str,
        version: int,
        buckets: int | None = None,
        direct: dict[str, int | None] | None = None,
    ) -> int:
        """Switch to the received tensors; return the new version.

        ``buckets``: how many buckets the sender sent; fewer received is an error (and an
        abort: staged keeps the old weights serving, inplace refuses requests).
        ``direct``: the tensors the sender wrote straight into the offered arena, each with
        its CRC32 (or ``None``); an unoffered name or a checksum mismatch aborts the transfer.
        """
        with self._lock:
            self._check(transfer_id)
            problem = self._accept_direct(transfer_id, direct or {})
            if problem is None and buckets is not None and len(self._seen) != buckets:
                missing = sorted(set(range(buckets)) - self._seen)
                problem = (
                    f"transfer {transfer_id} sent {buckets} buckets but buckets {missing} never "
                    "arrived"
                )
            elif problem is None:
                incomplete = sorted(n for n, s in self._slots.items() if s.filled != s.total)
                if incomplete:
                    problem = f"transfer {transfer_id} ended with incomplete tensors {incomplete}"
            if problem is not None:
                self._abort_locked(transfer_id, problem)
                raise WeightTransferError(problem + "; the old weights keep serving")
            names = list(dict.fromkeys(self._done))
            # Stop the watchdog, keep the transfer marked busy until the switch is done.
            if self._stop is not None:
                self._stop.set()
            try:
                new_version = self.target.commit(transfer_id, names, version)
            except Exception as exc:
                self._finish_stats(transfer_id, f"failed: {exc}")
                self._reset()
                raise
            self._finish_stats(transfer_id, "committed")
            self._reset()
            return new_version
