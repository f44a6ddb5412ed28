"""The :class:`Batch` container passed between every polyrl service.

A :class:`Batch` holds columns that share one leading batch dimension ``B``:

* ``tensors`` -- a :class:`tensordict.TensorDict` with ``batch_size=[B]`` (token ids, masks,
  log-probs, advantages, ...);
* ``non_tensors`` -- a ``dict`` of 1-D ``numpy`` object arrays of length ``B`` (prompts as strings,
  per-row dicts of ground truth, lists of tool calls, variable-length tensors, ...);
* ``meta`` -- a free-form ``dict`` that is carried along but never indexed (weight version,
  sampling temperature, ...).

Cross-process transfer
----------------------
``Batch.__reduce__`` turns every tensor column into a contiguous CPU ``numpy`` view of the same
memory.  Pickle protocol 5 (used by Ray) ships numpy arrays as out-of-band buffers, so a Batch put
into Ray's object store is written once and read back **zero-copy**: on the receiving side each
tensor is rebuilt with :func:`torch.from_numpy` directly on top of the shared-memory buffer.
dtypes numpy lacks (``bfloat16``, the ``float8`` family, ``complex32``, ...) travel as an integer
view of the same width and are re-viewed as their torch dtype on arrival.

Tensors received from Ray's object store are therefore backed by **read-only shared memory**:
reading them is free, but they must not be modified in place (the store hands the same bytes to
every reader on the node).  Call :meth:`Batch.clone` (or ``tensor.clone()``) before writing.
Tensors on an accelerator are moved to CPU when pickled and arrive on CPU; use :meth:`Batch.to`.
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from tensordict import TensorDict, TensorDictBase

__all__ = ["Batch", "collate"]

# Torch dtypes whose ``Tensor.numpy()`` works directly; every other dtype is shipped as an
# integer view of equal element size and re-viewed on arrival.
_NUMPY_NATIVE_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)
_INT_VIEW_BY_ITEMSIZE: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}
_READONLY_WARNING = "The given NumPy array is not writable"
_FILE_FORMAT = "polyrl.Batch"
_FILE_VERSION = 1


def _tensordict_class() -> type[TensorDict]:
    """Return :class:`tensordict.TensorDict`, imported on first use.

    Importing tensordict imports ``torch._dynamo`` too: about as much CPU time as torch itself
    (~1.3 s). A process that imports this module but never builds a Batch (a transfer storage
    unit, a rollout replica's Ray actor) starts that much sooner.
    """
    from tensordict import TensorDict

    return TensorDict


def _is_tensordict(value: Any) -> bool:
    """Whether ``value`` is a TensorDict (of any kind), without importing tensordict."""
    module = sys.modules.get("tensordict")
    return module is not None and isinstance(value, module.TensorDictBase)


# ----------------------------------------------------------------------------------------------
# Column helpers
# ----------------------------------------------------------------------------------------------
def _check_key(key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise TypeError(f"Batch column names must be non-empty str, got {key!r}")
    return key


def _as_tensor_column(key: str, value: torch.Tensor) -> torch.Tensor:
    if _is_tensordict(value):
        raise TypeError(
            f"column {key!r}: nested TensorDicts are not supported; store each tensor as its "
            "own column"
        )
    if value.layout != torch.strided:
        raise TypeError(
            f"column {key!r}: only strided (dense) tensors are supported, got {value.layout}"
        )
    if value.ndim == 0:
        raise ValueError(
            f"column {key!r}: tensor columns need a leading batch dimension, got a 0-dim tensor"
        )
    return value


def _as_object_column(key: str, value: Any) -> np.ndarray:
    """Turn ``value`` into a 1-D numpy object array with one element per row."""
    if _is_tensordict(value):
        raise TypeError(f"column {key!r}: nested TensorDicts are not supported")
    if isinstance(value, str | bytes | bytearray) or isinstance(value, Mapping):
        raise TypeError(
            f"column {key!r}: expected a sequence or numpy array with one element per row, got "
            f"{type(value).__name__}"
        )
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"column {key!r}: expected a 1-D array of rows, got a 0-dim array")
        if value.dtype == object and value.ndim == 1:
            return value
        # Numeric 1-D arrays become Python scalars; N-D arrays become one sub-array per row.
        items = value.tolist() if value.ndim == 1 else list(value)
    elif isinstance(value, Sequence):
        items = value
    else:
        raise TypeError(
            f"column {key!r}: expected a torch.Tensor, numpy array or sequence, got "
            f"{type(value).__name__}"
        )
    out = np.empty(len(items), dtype=object)
    # Element-wise assignment: np.array(list_of_lists) would build a 2-D array instead.
    for i, item in enumerate(items):
        out[i] = item
    return out


def _column_len(value: torch.Tensor | np.ndarray) -> int:
    return int(value.shape[0])


def _normalize_index(index: Any, n: int) -> slice | np.ndarray:
    """Turn any supported row index into a slice or an int64 numpy array of valid positions."""
    if isinstance(index, bool | np.bool_):
        raise TypeError("a bare bool is not a valid Batch row index; use a boolean mask")
    if isinstance(index, int | np.integer):
        i = int(index)
        if not -n <= i < n:
            raise IndexError(f"row index {i} is out of range for a Batch of length {n}")
        i = i + n if i < 0 else i
        return slice(i, i + 1)
    if isinstance(index, slice):
        return slice(*index.indices(n))
    if isinstance(index, torch.Tensor):
        arr = index.detach().cpu().numpy()
    elif isinstance(index, np.ndarray):
        arr = index
    elif isinstance(index, Sequence | range):
        arr = np.asarray(list(index))
        if arr.size == 0:
            arr = arr.astype(np.int64)
    else:
        raise TypeError(
            "Batch rows are indexed by int, slice, list of ints, boolean mask, numpy array or "
            f"torch tensor; got {type(index).__name__}"
        )
    if arr.ndim == 0 and np.issubdtype(arr.dtype, np.integer):
        return _normalize_index(int(arr), n)
    if arr.ndim != 1:
        raise IndexError(f"row index arrays must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype == np.bool_:
        if arr.shape[0] != n:
            raise IndexError(
                f"boolean mask has length {arr.shape[0]}, expected the Batch length {n}"
            )
        return np.flatnonzero(arr).astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"row index arrays must hold integers or bools, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < -n or arr.max() >= n):
        bad = int(arr[(arr < -n) | (arr >= n)][0])
        raise IndexError(f"row index {bad} is out of range for a Batch of length {n}")
    return np.where(arr < 0, arr + n, arr)


def _values_equal(a: Any, b: Any) -> bool:
    """Structural equality that treats NaN as equal to NaN and never raises."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.dtype not in _NUMPY_NATIVE_DTYPES:
            # Compare raw bits: many exotic dtypes (float8, complex32) lack eq kernels.
            return torch.equal(_int_view(a.contiguous()), _int_view(b.contiguous()))
        if a.is_floating_point() or a.is_complex():
            same = (a == b) | (torch.isnan(a) & torch.isnan(b))
            return bool(same.all())
        return torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(_values_equal(x, y) for x, y in zip(a.ravel(), b.ravel(), strict=True))
        if a.dtype != b.dtype:
            return False
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_values_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    try:
        return bool(a == b)
    except Exception:  # arbitrary objects may raise from == or from bool() of its result
        return False


def _merge_meta(metas: Sequence[Mapping[str, Any]], what: str) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for i, meta in enumerate(metas):
        for k, v in meta.items():
            if k in merged and not _values_equal(merged[k], v):
                raise ValueError(
                    f"{what}: meta key {k!r} conflicts ({merged[k]!r} vs {v!r} in batch {i}); "
                    "meta values shared by several batches must be equal"
                )
            merged.setdefault(k, v)
    return merged


def _int_view(t: torch.Tensor) -> torch.Tensor:
    try:
        return t.view(_INT_VIEW_BY_ITEMSIZE[t.element_size()])
    except (KeyError, RuntimeError) as exc:
        raise TypeError(f"cannot ship tensors of dtype {t.dtype} as raw bytes") from exc


def _tensor_to_numpy(key: str, t: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """CPU numpy view of ``t`` (no copy when already contiguous on CPU) plus its torch dtype."""
    t = t.detach()
    if t.is_quantized:
        raise TypeError(f"column {key!r}: quantized tensors cannot be pickled by Batch")
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.dtype in _NUMPY_NATIVE_DTYPES:
        return t.numpy(), None
    try:
        view = _int_view(t)
    except TypeError as exc:
        raise TypeError(f"column {key!r}: {exc}") from None
    return view.numpy(), str(t.dtype).removeprefix("torch.")


def _tensor_from_numpy(arr: np.ndarray, dtype_name: str | None) -> torch.Tensor:
    if arr.flags.writeable:
        t = torch.from_numpy(arr)
    else:
        # Buffers from Ray's object store are read-only; sharing them is the point, so silence
        # torch's warning (documented in the module docstring) rather than copying.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_READONLY_WARNING, category=UserWarning)
            t = torch.from_numpy(arr)
    if dtype_name is not None:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"pickled Batch names unknown torch dtype {dtype_name!r}")
        t = t.view(dtype)
    return t


def _rebuild_batch(
    tensor_payload: Sequence[tuple[str, np.ndarray, str | None]],
    non_tensors: dict[str, np.ndarray],
    meta: dict[str, Any],
    length: int,
) -> Batch:
    """Unpickle hook for :meth:`Batch.__reduce__` (zero-copy on the tensor columns)."""
    tensors = {key: _tensor_from_numpy(arr, dt) for key, arr, dt in tensor_payload}
    return Batch._from_parts(tensors, non_tensors, meta, length)


# ----------------------------------------------------------------------------------------------
# Batch
# ----------------------------------------------------------------------------------------------
class Batch:
    """Columns sharing one batch dimension: tensors, non-tensors (object arrays) and meta.

    Args:
        tensors: tensor columns, each with leading dimension ``B``; a flat mapping or TensorDict.
        non_tensors: per-row Python objects; each value is a sequence or numpy array of length
            ``B`` and is stored as a 1-D ``dtype=object`` array.
        meta: free-form values carried along unchanged by every operation (never indexed).
        batch_size: ``B``; required only to build a column-less Batch of non-zero length. When
            given together with columns it must agree with them.

    Row operations (indexing, :meth:`chunk`, :meth:`split`, ...) return new Batches.  Like torch,
    slices share memory with the source; fancy indexing copies.  ``meta`` is shallow-copied.
    """

    tensors: TensorDict
    non_tensors: dict[str, np.ndarray]
    meta: dict[str, Any]

    def __init__(
        self,
        tensors: TensorDict | Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, np.ndarray | Sequence[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
        batch_size: int | None = None,
    ) -> None:
        if batch_size is not None and (
            not isinstance(batch_size, int | np.integer)
            or isinstance(batch_size, bool)
            or batch_size < 0
        ):
            raise ValueError(f"batch_size must be a non-negative int, got {batch_size!r}")
        if meta is not None and not isinstance(meta, Mapping):
            raise TypeError(f"meta must be a mapping, got {type(meta).__name__}")

        tensor_cols: dict[str, torch.Tensor] = {}
        if tensors is not None:
            if not (isinstance(tensors, Mapping) or _is_tensordict(tensors)):
                raise TypeError(
                    f"tensors must be a TensorDict or a mapping of str to torch.Tensor, got "
                    f"{type(tensors).__name__}"
                )
            for key, value in tensors.items():
                _check_key(key)
                if not (isinstance(value, torch.Tensor) or _is_tensordict(value)):
                    raise TypeError(
                        f"tensors[{key!r}] must be a torch.Tensor, got {type(value).__name__}; "
                        "put non-tensor data in non_tensors"
                    )
                tensor_cols[key] = _as_tensor_column(key, value)
        object_cols: dict[str, np.ndarray] = {}
        if non_tensors is not None:
            if not isinstance(non_tensors, Mapping):
                raise TypeError(f"non_tensors must be a mapping, got {type(non_tensors).__name__}")
            for key, value in non_tensors.items():
                _check_key(key)
                if key in tensor_cols:
                    raise ValueError(f"column {key!r} is given both as a tensor and a non-tensor")
                object_cols[key] = _as_object_column(key, value)

        lengths = {k: _column_len(v) for k, v in {**tensor_cols, **object_cols}.items()}
        if batch_size is not None:
            n = int(batch_size)
            expected = f"batch_size={n}"
        elif lengths:
            first = next(iter(lengths))
            n = lengths[first]
            expected = f"length {n} of column {first!r}"
        else:
            n = 0
            expected = ""
        bad = {k: m for k, m in lengths.items() if m != n}
        if bad:
            raise ValueError(
                f"column length mismatch: {bad} (expected {expected}); every column must have "
                "the same leading dimension"
            )
        self.tensors = _tensordict_class()(tensor_cols, batch_size=[n])
        self.non_tensors = object_cols
        self.meta = dict(meta) if meta is not None else {}
        # A Batch built from nothing adopts the length of its first column (see __setitem__).
        self._sized = batch_size is not None or bool(lengths)

    @classmethod
    def _from_parts(
        cls,
        tensors: Mapping[str, torch.Tensor] | TensorDictBase,
        non_tensors: Mapping[str, np.ndarray],
        meta: Mapping[str, Any],
        length: int,
    ) -> Batch:
        """Build from already-validated columns (skips per-column conversion)."""
        out = cls.__new__(cls)
        if _is_tensordict(tensors):
            out.tensors = tensors
        else:
            out.tensors = _tensordict_class()(dict(tensors), batch_size=[length])
        out.non_tensors = dict(non_tensors)
        out.meta = dict(meta)
        out._sized = True
        return out

    # ------------------------------------------------------------------ basic container protocol
    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    @property
    def tensor_keys(self) -> list[str]:
        """Names of the tensor columns, in insertion order."""
        return list(self.tensors.keys())

    @property
    def non_tensor_keys(self) -> list[str]:
        """Names of the non-tensor (object) columns, in insertion order."""
        return list(self.non_tensors.keys())

    def keys(self) -> list[str]:
        """Tensor column names followed by non-tensor column names."""
        return self.tensor_keys + self.non_tensor_keys

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (key in self.non_tensors or key in self.tensors.keys())

    def __iter__(self) -> Iterator[Any]:
        raise TypeError("Batch is not iterable; use .keys() for column names or .rows() for rows")

    def _unknown(self, keys: Iterable[str]) -> list[str]:
        return [k for k in keys if k not in self]

    def _raise_unknown(self, keys: Sequence[str], op: str) -> None:
        missing = self._unknown(keys)
        if missing:
            raise KeyError(f"{op}: unknown column(s) {missing}; available columns: {self.keys()}")

    def __getitem__(self, key: Any) -> Any:
        """``str`` -> the column; anything else indexes rows and returns a new Batch.

        An ``int`` returns a Batch of length 1 (not a row dict; use :meth:`rows` for that).
        """
        if isinstance(key, str):
            if key in self.non_tensors:
                return self.non_tensors[key]
            if key in self.tensors.keys():
                return self.tensors[key]
            raise KeyError(f"unknown column {key!r}; available columns: {self.keys()}")
        return self._take(_normalize_index(key, len(self)))

    def _take(self, index: slice | np.ndarray) -> Batch:
        if isinstance(index, slice):
            tensors = self.tensors[index]
            objects = {k: v[index] for k, v in self.non_tensors.items()}
            length = len(range(*index.indices(len(self))))
        else:
            tensors = self.tensors[torch.from_numpy(index)]
            objects = {k: v[index] for k, v in self.non_tensors.items()}
            length = int(index.shape[0])
        return Batch._from_parts(tensors, objects, self.meta, length)

    def __setitem__(self, key: str, value: Any) -> None:
        """Add or replace a column; tensors go to ``tensors``, anything else to ``non_tensors``."""
        _check_key(key)
        if isinstance(value, torch.Tensor) and not _is_tensordict(value):
            column: torch.Tensor | np.ndarray = _as_tensor_column(key, value)
        else:
            column = _as_object_column(key, value)
        m = _column_len(column)
        others = [k for k in self.keys() if k != key]
        if m != len(self) and (others or self._sized):
            raise ValueError(
                f"column {key!r} has length {m}, expected the Batch length {len(self)}"
            )
        if not others and m != len(self):
            # Column-less, unsized Batch: the first column defines the length.
            self.tensors = _tensordict_class()({}, batch_size=[m])
        self._sized = True
        if key in self.non_tensors:
            del self.non_tensors[key]
        if key in self.tensors.keys():
            del self.tensors[key]
        if isinstance(column, torch.Tensor):
            self.tensors[key] = column
        else:
            self.non_tensors[key] = column

    def __delitem__(self, key: str) -> None:
        if key in self.non_tensors:
            del self.non_tensors[key]
        elif key in self:
            del self.tensors[key]
        else:
            raise KeyError(f"unknown column {key!r}; available columns: {self.keys()}")

    def __repr__(self) -> str:
        def _fmt(t: torch.Tensor) -> str:
            dt = str(t.dtype).removeprefix("torch.")
            dev = "" if t.device.type == "cpu" else f" {t.device}"
            return f"{dt}{list(t.shape)}{dev}"

        tensors = ", ".join(f"{k}: {_fmt(v)}" for k, v in self.tensors.items())
        objects = ", ".join(self.non_tensors)
        return (
            f"Batch(len={len(self)}, tensors={{{tensors}}}, non_tensors=[{objects}], "
            f"meta_keys={list(self.meta)})"
        )

    # ---------------------------------------------------------------------------- column ops
    def select(self, *keys: str, meta_keys: Sequence[str] | None = None) -> Batch:
        """Keep only the columns ``keys`` (no keys: no columns, same length).

        ``meta_keys=None`` keeps all meta; otherwise only the listed meta keys are kept.
        """
        self._raise_unknown(keys, "select")
        if meta_keys is None:
            meta = self.meta
        else:
            if isinstance(meta_keys, str):
                raise TypeError("meta_keys must be a sequence of str, not a single str")
            missing = [k for k in meta_keys if k not in self.meta]
            if missing:
                raise KeyError(
                    f"select: unknown meta key(s) {missing}; available meta keys: {list(self.meta)}"
                )
            meta = {k: self.meta[k] for k in meta_keys}
        tensor_keys = [k for k in keys if k in self.tensors.keys()]
        tensors = {k: self.tensors[k] for k in tensor_keys}
        objects = {k: self.non_tensors[k] for k in keys if k in self.non_tensors}
        return Batch._from_parts(tensors, objects, meta, len(self))

    def drop(self, *keys: str) -> Batch:
        """Remove the columns ``keys`` (each must exist) and return the new Batch."""
        self._raise_unknown(keys, "drop")
        gone = set(keys)
        tensors = {k: v for k, v in self.tensors.items() if k not in gone}
        objects = {k: v for k, v in self.non_tensors.items() if k not in gone}
        return Batch._from_parts(tensors, objects, self.meta, len(self))

    def union(self, other: Batch) -> Batch:
        """Columns of both Batches; a column in both must hold equal values (else ``ValueError``).

        Meta is merged the same way.  Column order: ``self``'s, then ``other``'s new ones.
        """
        if not isinstance(other, Batch):
            raise TypeError(f"union expects a Batch, got {type(other).__name__}")
        if len(self) != len(other):
            raise ValueError(f"union: lengths differ ({len(self)} vs {len(other)})")
        tensors = dict(self.tensors.items())
        objects = dict(self.non_tensors)
        for key, value in other.tensors.items():
            if key in objects:
                raise ValueError(
                    f"union: column {key!r} is a non-tensor in self but a tensor in other"
                )
            if key in tensors and not _values_equal(tensors[key], value):
                raise ValueError(f"union: column {key!r} differs between the two batches")
            tensors.setdefault(key, value)
        for key, value in other.non_tensors.items():
            if key in tensors:
                raise ValueError(
                    f"union: column {key!r} is a tensor in self but a non-tensor in other"
                )
            if key in objects and not _values_equal(objects[key], value):
                raise ValueError(f"union: column {key!r} differs between the two batches")
            objects.setdefault(key, value)
        meta = _merge_meta([self.meta, other.meta], "union")
        return Batch._from_parts(tensors, objects, meta, len(self))

    # ------------------------------------------------------------------------------- row ops
    def chunk(self, n: int, allow_empty: bool = False) -> list[Batch]:
        """Split into exactly ``n`` contiguous, nearly equal parts (sizes differ by at most 1).

        Unlike :func:`torch.chunk` this always returns ``n`` parts; the first ``len % n`` parts get
        one extra row (like :func:`numpy.array_split`).  With ``len < n`` some parts would be
        empty, which raises ``ValueError`` unless ``allow_empty=True``.
        """
        n = _positive_int(n, "chunk: n")
        if len(self) < n and not allow_empty:
            raise ValueError(
                f"chunk: cannot split a Batch of length {len(self)} into {n} non-empty parts; "
                "pass allow_empty=True to accept empty parts"
            )
        base, extra = divmod(len(self), n)
        parts, start = [], 0
        for i in range(n):
            stop = start + base + (1 if i < extra else 0)
            parts.append(self[start:stop])
            start = stop
        return parts

    def split(self, size: int) -> list[Batch]:
        """Cut into parts of ``size`` rows, the last possibly smaller; ``[]`` for an empty Batch."""
        size = _positive_int(size, "split: size")
        return [self[i : i + size] for i in range(0, len(self), size)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Stack Batches row-wise.

        All Batches must have exactly the same tensor and non-tensor columns, and each tensor
        column the same dtype, trailing shape and device.  Meta is merged: a key present in
        several Batches must hold equal values.  Column-less, meta-less empty Batches (e.g.
        ``Batch()``) are ignored, so they can seed an accumulator; ``concat([])`` is ``Batch()``.
        """
        batches = list(batches)
        for i, b in enumerate(batches):
            if not isinstance(b, Batch):
                raise TypeError(f"concat: item {i} is a {type(b).__name__}, expected a Batch")
        parts = [b for b in batches if len(b) or b.keys() or b.meta]
        if not parts:
            return Batch()
        first = parts[0]
        tkeys, okeys = first.tensor_keys, first.non_tensor_keys
        for i, b in enumerate(parts[1:], start=1):
            if set(b.tensor_keys) != set(tkeys) or set(b.non_tensor_keys) != set(okeys):
                missing = sorted(set(first.keys()) - set(b.keys()))
                extra = sorted(set(b.keys()) - set(first.keys()))
                moved = sorted(
                    (set(b.tensor_keys) & set(okeys)) | (set(b.non_tensor_keys) & set(tkeys))
                )
                raise ValueError(
                    f"concat: batch {i} has different columns from batch 0 (missing {missing}, "
                    f"extra {extra}, tensor/non-tensor mismatch {moved}); keys must match exactly"
                )
        tensors: dict[str, torch.Tensor] = {}
        for key in tkeys:
            cols = [b.tensors[key] for b in parts]
            ref = cols[0]
            for i, c in enumerate(cols[1:], start=1):
                if c.dtype != ref.dtype or c.shape[1:] != ref.shape[1:] or c.device != ref.device:
                    raise ValueError(
                        f"concat: column {key!r} in batch {i} is {c.dtype}{list(c.shape[1:])} on "
                        f"{c.device}, expected {ref.dtype}{list(ref.shape[1:])} on {ref.device} "
                        "(dtype, trailing shape and device must match)"
                    )
            tensors[key] = torch.cat(cols, dim=0)
        objects = {k: np.concatenate([b.non_tensors[k] for b in parts]) for k in okeys}
        meta = _merge_meta([b.meta for b in parts], "concat")
        return Batch._from_parts(tensors, objects, meta, sum(len(b) for b in parts))

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row ``n`` times: ``a a b b`` when ``interleave`` else ``a b a b``."""
        n = _positive_int(n, "repeat: n")
        rows = np.arange(len(self), dtype=np.int64)
        idx = np.repeat(rows, n) if interleave else np.tile(rows, n)
        return self._take(idx)

    def pad_to_multiple(self, k: int) -> tuple[Batch, int]:
        """Append rows copied from the start (cycling) until the length divides by ``k``.

        Returns the padded Batch and the number of rows added (pass it to :meth:`unpad`).
        An empty Batch needs no padding.
        """
        k = _positive_int(k, "pad_to_multiple: k")
        n = len(self)
        pad = (-n) % k
        if pad == 0:
            return self._take(slice(0, n)), 0
        idx = np.concatenate([np.arange(n), np.arange(pad) % n]).astype(np.int64)
        return self._take(idx), pad

    def unpad(self, pad_size: int) -> Batch:
        """Drop the last ``pad_size`` rows (the inverse of :meth:`pad_to_multiple`)."""
        if not isinstance(pad_size, int | np.integer) or isinstance(pad_size, bool):
            raise TypeError(f"unpad: pad_size must be an int, got {type(pad_size).__name__}")
        if not 0 <= pad_size <= len(self):
            raise ValueError(
                f"unpad: pad_size must be between 0 and the Batch length {len(self)}, "
                f"got {pad_size}"
            )
        return self._take(slice(0, len(self) - int(pad_size)))

    def reorder(self, idx: torch.Tensor | np.ndarray | Sequence[int]) -> Batch:
        """Rows permuted so that row ``i`` of the result is row ``idx[i]`` of ``self``.

        ``idx`` must be a permutation of ``range(len(self))``.
        """
        if isinstance(idx, torch.Tensor):
            arr = idx.detach().cpu().numpy()
        else:
            arr = np.asarray(idx)
        n = len(self)
        if arr.ndim != 1 or arr.shape[0] != n:
            raise ValueError(
                f"reorder: expected a 1-D permutation of length {n}, got shape {tuple(arr.shape)}"
            )
        if n and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"reorder: permutation must hold integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
        if not np.array_equal(np.sort(arr), np.arange(n)):
            raise ValueError(
                f"reorder: index is not a permutation of range({n}) (repeated or out-of-range "
                "entries)"
            )
        return self._take(arr)

    # ------------------------------------------------------------------------ devices & copies
    def to(self, device: torch.device | str | int) -> Batch:
        """Move every tensor column to ``device`` (non-tensor columns are shared, not copied)."""
        return Batch._from_parts(self.tensors.to(device), self.non_tensors, self.meta, len(self))

    def clone(self) -> Batch:
        """Copy into memory this Batch owns: tensors cloned, object arrays and meta shallow-copied.

        Use it before writing into tensors received from Ray (they are read-only shared memory).
        """
        tensors = {k: v.clone() for k, v in self.tensors.items()}
        objects = {k: v.copy() for k, v in self.non_tensors.items()}
        return Batch._from_parts(tensors, objects, self.meta, len(self))

    def equals(self, other: Any) -> bool:
        """Tell whether ``other`` is a Batch with the same columns, dtypes, values and meta.

        NaN compares equal to NaN; column order does not matter.
        """
        if not isinstance(other, Batch) or len(self) != len(other):
            return False
        if set(self.tensor_keys) != set(other.tensor_keys):
            return False
        if set(self.non_tensor_keys) != set(other.non_tensor_keys):
            return False
        return (
            all(_values_equal(v, other.tensors[k]) for k, v in self.tensors.items())
            and all(_values_equal(v, other.non_tensors[k]) for k, v in self.non_tensors.items())
            and _values_equal(self.meta, other.meta)
        )

    def __copy__(self) -> Batch:
        return Batch._from_parts(dict(self.tensors.items()), self.non_tensors, self.meta, len(self))

    def __deepcopy__(self, memo: dict[int, Any]) -> Batch:
        tensors = {k: v.clone() for k, v in self.tensors.items()}
        objects = copy.deepcopy(self.non_tensors, memo)
        meta = copy.deepcopy(self.meta, memo)
        return Batch._from_parts(tensors, objects, meta, len(self))

    # ------------------------------------------------------------------------------ pickling
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle tensors as numpy views so pickle-5 consumers (Ray) move them zero-copy."""
        payload = tuple((key, *_tensor_to_numpy(key, value)) for key, value in self.tensors.items())
        return _rebuild_batch, (payload, self.non_tensors, self.meta, len(self))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the Batch to ``path`` atomically (temporary file in the same folder + rename).

        The file is a pickle: load only files you trust.
        """
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"Batch.save: folder {folder!r} does not exist")
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                record = {"format": _FILE_FORMAT, "version": _FILE_VERSION, "batch": self}
                pickle.dump(record, f, protocol=5)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Batch:
        """Read a Batch written by :meth:`save` (tensors come back writable, on CPU)."""
        with open(path, "rb") as f:
            try:
                record = pickle.load(f)
            except (pickle.UnpicklingError, EOFError, ValueError) as exc:
                raise ValueError(f"Batch.load: {os.fspath(path)!r} is not a saved Batch") from exc
        if (
            not isinstance(record, dict)
            or record.get("format") != _FILE_FORMAT
            or not isinstance(record.get("batch"), Batch)
        ):
            raise ValueError(f"Batch.load: {os.fspath(path)!r} is not a saved Batch")
        if record.get("version") != _FILE_VERSION:
            raise ValueError(
                f"Batch.load: {os.fspath(path)!r} has format version {record.get('version')!r}, "
                f"this polyrl reads version {_FILE_VERSION}"
            )
        return record["batch"]

    # ---------------------------------------------------------------------------------- rows
    @classmethod
    def from_rows(
        cls, rows: Iterable[Mapping[str, Any]], meta: Mapping[str, Any] | None = None
    ) -> Batch:
        """Build a Batch from per-row dicts (all with the same keys).

        A key whose values are all tensors becomes a stacked tensor column (shapes must match);
        any other key becomes a non-tensor column.  ``from_rows([])`` is an empty Batch.
        """
        rows = list(rows)
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise TypeError(f"from_rows: row {i} is a {type(row).__name__}, expected a mapping")
        if not rows:
            return cls(meta=meta)
        keys = list(rows[0].keys())
        for i, row in enumerate(rows[1:], start=1):
            if row.keys() != rows[0].keys():
                missing = sorted(set(keys) - set(row))
                extra = sorted(set(row) - set(keys))
                raise ValueError(
                    f"from_rows: row {i} has different keys from row 0 (missing {missing}, "
                    f"extra {extra})"
                )
        tensors: dict[str, torch.Tensor] = {}
        objects: dict[str, list[Any]] = {}
        for key in keys:
            _check_key(key)
            values = [row[key] for row in rows]
            is_tensor = [isinstance(v, torch.Tensor) for v in values]
            if all(is_tensor):
                shapes = {tuple(v.shape) for v in values}
                if len(shapes) > 1:
                    raise ValueError(
                        f"from_rows: column {key!r} holds tensors of different shapes "
                        f"{sorted(shapes)}; pad them to one shape or pass a list as a non-tensor"
                    )
                dtypes = {v.dtype for v in values}
                if len(dtypes) > 1:
                    raise ValueError(
                        f"from_rows: column {key!r} mixes tensor dtypes "
                        f"{sorted(str(d) for d in dtypes)}"
                    )
                tensors[key] = torch.stack(values)
            elif any(is_tensor):
                raise ValueError(
                    f"from_rows: column {key!r} mixes tensors and non-tensors across rows"
                )
            else:
                objects[key] = values
        return cls(tensors, objects, meta=meta, batch_size=len(rows))

    def rows(self) -> Iterator[dict[str, Any]]:
        """Yield one dict per row; tensor values are per-row views (``column[i]``)."""
        tensors = dict(self.tensors.items())
        for i in range(len(self)):
            row: dict[str, Any] = {k: v[i] for k, v in tensors.items()}
            row.update({k: v[i] for k, v in self.non_tensors.items()})
            yield row


def _positive_int(value: Any, what: str) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")
    return int(value)


def collate(rows: Sequence[Mapping[str, Any]]) -> Batch:
    """``collate_fn`` for a torch ``DataLoader`` over dict samples: :meth:`Batch.from_rows`."""
    return Batch.from_rows(rows)
