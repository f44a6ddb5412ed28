"""Small C kernels for the native engine on CPU, compiled on first use and called through ctypes.

Decode attention over a paged KV cache is memory bound: in pure torch each step gathers every
sequence's keys and values through its block table into a padded copy, then attention reads
the copy again. :func:`paged_decode_attention` instead reads keys and values in place, block by
block, one pass each, so a decode step touches the cache once and computes nothing on padding.
Where the compiler targets AVX2 with FMA (``-march=native`` on such a CPU) it uses a vectorised
variant: the scores of 8 keys share one transposing reduction, the softmax's exponentials are
computed 8 at a time (a polynomial accurate to float32 rounding; glibc's ``expf`` is scalar),
and each head's output accumulates in registers. Both variants prefetch the next cache block
while the current one is read (blocks are scattered pages, where hardware prefetchers stop);
with one thread the vectorised one also fetches the next sequence's keys during the current
sequence's value pass, which otherwise leaves the memory bus idle.
:func:`silu_mul`, :func:`add_rms_norm` and :func:`rope_and_store` fuse small elementwise ops
that cost more in torch dispatch than in arithmetic at these sizes.

The kernels are C, in ``csrc/cpu_kernels.c`` beside this module (shipped as package data). On
first use that file is compiled with the system C compiler (``$CC``, else ``cc``/``gcc``) into a
shared library cached under ``$POLYRL_KERNEL_DIR`` (default ``~/.cache/polyrl/kernels``), keyed
by a hash of the source, the flags, the compiler and the CPU. Nothing is downloaded. When no
compiler is found, the source file is missing, compilation fails, or ``POLYRL_NATIVE_KERNELS=0``
is set, :func:`available` is ``False`` and callers use their torch path instead (same results up
to float rounding); :func:`unavailable_reason` says which of these happened.
The library links OpenMP; torch has loaded its own ``libgomp.so.1`` already, so both share one
thread pool instead of competing with two.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path

import torch

__all__ = [
    "KernelBuildError",
    "add_rms_norm",
    "available",
    "inverse_sample",
    "paged_decode_attention",
    "rope_and_store",
    "silu_mul",
    "unavailable_reason",
]

logger = logging.getLogger(__name__)

# The kernels' C source, relative to this module's package.
_SOURCE_FILE = "csrc/cpu_kernels.c"

# Tried in order: the first set that compiles wins (no OpenMP, no -march as a last resort).
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
    ["-O3", "-fopenmp", "-fno-math-errno"],
    ["-O3", "-fno-math-errno"],
)
# Added to every set: the source is kept free of their warnings (tests build it with -Werror).
_WARNING_FLAGS = ("-Wall", "-Wextra")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
# Why _lib is None once _tried (None while the kernels load, or before the first try).
_why: str | None = None


class KernelBuildError(RuntimeError):
    """The C compiler rejected the kernels' source; the message holds its command and errors."""


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_id() -> str:
    """Describe the CPU (-march=native code built for one CPU may not run on another)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    return platform.machine() + line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _cache_dir() -> Path:
    configured = os.environ.get("POLYRL_KERNEL_DIR")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "polyrl" / "kernels"


def _source() -> str:
    """Read the kernels' C source from the package (works from a zip install too)."""
    return resources.files(__spec__.parent).joinpath(_SOURCE_FILE).read_text(encoding="utf-8")


def _build(cc: str, flags: list[str], out: Path, source: str, *, werror: bool = False) -> None:
    """Compile ``source`` with ``flags`` into the shared library ``out``.

    The text compiled is the text the caller hashed into ``out``'s name: it is written to a
    scratch file here rather than compiled in place from the package. ``-Wall -Wextra`` are
    always on; ``werror`` makes their warnings errors (for tests).

    Raises:
        KernelBuildError: the compiler failed (the message ends with its last errors).
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "kernels.c"
        src.write_text(source, encoding="utf-8")
        target = Path(tmp) / out.name
        cmd = [cc, *flags, *_WARNING_FLAGS, *(["-Werror"] if werror else [])]
        cmd += ["-shared", "-fPIC", str(src), "-o", str(target), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise KernelBuildError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        if proc.stderr.strip():
            logger.debug("kernel build warnings (%s): %s", " ".join(cmd), proc.stderr[-2000:])
        # Atomic: a concurrent process either sees no library or a complete one.
        os.replace(target, out)


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """Build (or find cached) and load the library: ``(library, None)`` or ``(None, why not)``."""
    if os.environ.get("POLYRL_NATIVE_KERNELS", "1").strip().lower() in ("0", "false", "no"):
        return None, "POLYRL_NATIVE_KERNELS turns them off"
    cc = _compiler()
    if cc is None:
        logger.info("no C compiler found; the native engine uses its torch attention path")
        return None, "no C compiler found ($CC, cc, gcc, clang)"
    try:
        source = _source()
    except OSError as exc:
        logger.warning("the native engine's C source is missing (%s); using the torch path", exc)
        return None, f"their C source is missing: {exc}"
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    failure = "no flag set built them"
    for flags in _FLAG_SETS:
        key = hashlib.sha256(
            "\0".join([source, " ".join([*flags, *_WARNING_FLAGS]), version, _cpu_id()]).encode()
        ).hexdigest()[:24]
        for directory in (_cache_dir(), Path(tempfile.gettempdir()) / "polyrl-kernels"):
            path = directory / f"polyrl_kernels_{key}.so"
            try:
                if not path.exists():
                    _build(cc, flags, path, source)
                lib = ctypes.CDLL(str(path))
            except KernelBuildError as exc:
                logger.debug("kernel build failed: %s", exc)
                failure = str(exc)
                break  # these flags do not compile here; try the next set
            except (OSError, subprocess.SubprocessError) as exc:
                logger.debug("kernel library at %s unusable: %s", path, exc)
                failure = f"the library at {path} is unusable: {exc}"
                continue  # e.g. an unwritable cache directory: try the next one
            fn = lib.polyrl_paged_decode_f32
            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr]
            fn.argtypes += [i64, i64, i64, i64, i64, i64, ctypes.c_float, i64, ctypes.c_int]
            fn.restype = ctypes.c_int
            fn = lib.polyrl_add_rms_norm_f32
            fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
            fn.restype = None
            fn = lib.polyrl_rope_store_f32
            fn.argtypes = [ptr] * 8 + [i64, i64, i64, i64, i64, ctypes.c_int]
            fn.restype = ctypes.c_int
            fn = lib.polyrl_silu_mul_f32
            fn.argtypes = [ptr, ptr, ptr, i64, ctypes.c_int]
            fn.restype = None
            fn = lib.polyrl_inverse_sample_f32
            fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64]
            fn.restype = ctypes.c_int
            return lib, None
    logger.warning("could not build the native engine's C kernels; using the torch path")
    # The last flag set's error: the one with the fewest flags, so the source's own fault.
    return None, f"they did not build: {failure}"


def _library() -> ctypes.CDLL | None:
    global _lib, _tried, _why
    if not _tried:
        with _lock:
            if not _tried:
                _lib, _why = _load()
                _tried = True
    return _lib


def _require_library() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("the native C kernels are not available (see cpu_kernels.available)")
    return lib


def available() -> bool:
    """Whether the compiled kernels can be used (compiles them on the first call)."""
    return _library() is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is ``False`` (turned off, no compiler, the build's errors); else None.

    Compiles the kernels on the first call, like :func:`available`.
    """
    return None if _library() is not None else _why


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged cache, read in place.

    Args:
        q: ``(B, heads, head_dim)`` float32 queries on the CPU (rows may be strided).
        k_cache: ``(num_blocks, block_size, kv_heads, head_dim)`` contiguous float32 keys.
        v_cache: values, same layout.
        block_table: ``(B, n)`` int64 block ids covering each sequence's ``kv_lens`` keys.
        kv_lens: ``(B,)`` int64 number of cached keys per sequence (its new token included).
        scale: softmax scale.
        sliding_window: attend to the last ``sliding_window`` keys only (``None``: all).

    Returns:
        ``(B, heads, head_dim)`` float32 attention output.

    Raises:
        RuntimeError: the kernels are unavailable, or the inputs break the layout above.
    """
    lib = _require_library()
    b, heads, dim = q.shape
    _, block_size, kv_heads, kdim = k_cache.shape
    ok = (
        q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and q.device.type == "cpu"
        and q.stride(2) == 1
        and q.stride(1) == dim
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and v_cache.shape == k_cache.shape
        and kdim == dim
        and heads % kv_heads == 0
        and block_table.dtype == kv_lens.dtype == torch.int64
        and block_table.stride(1) == 1
        and kv_lens.is_contiguous()
        and block_table.shape[0] == kv_lens.shape[0] == b
    )
    if not ok:
        raise RuntimeError(
            "paged_decode_attention expects float32 CPU tensors: q (B, H, D) with contiguous "
            f"rows, caches (blocks, block_size, kv_heads, D) contiguous, int64 tables; got q "
            f"{tuple(q.shape)} {q.dtype} strides {q.stride()}, cache {tuple(k_cache.shape)} "
            f"{k_cache.dtype}, table {tuple(block_table.shape)} {block_table.dtype}"
        )
    out = torch.empty((b, heads, dim), dtype=torch.float32)
    if b == 0:
        return out
    rc = lib.polyrl_paged_decode_f32(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        block_table.stride(0),
        kv_lens.data_ptr(),
        out.data_ptr(),
        b,
        heads,
        kv_heads,
        dim,
        block_size,
        k_cache.shape[0],
        float(scale),
        int(sliding_window or 0),
        torch.get_num_threads(),
    )
    if rc == -2:
        raise RuntimeError(
            "paged_decode_attention got a block table entry outside the cache or an empty "
            f"sequence (kv_lens {kv_lens.tolist()}, {k_cache.shape[0]} blocks)"
        )
    if rc != 0:
        raise MemoryError("paged_decode_attention could not allocate its scratch memory")
    return out


def rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Rotate ``q`` and ``k`` in place (HF ``rotate_half`` RoPE), then cache ``k`` and ``v``.

    Args:
        q: ``(T, heads, head_dim)`` contiguous float32 queries (rotated in place).
        k: ``(T, kv_heads, head_dim)`` contiguous float32 keys (rotated in place).
        v: ``(T, kv_heads, head_dim)`` contiguous float32 values.
        cos: ``(T, head_dim)`` contiguous float32 cosines of each token's position.
        sin: ``(T, head_dim)`` sines, same layout.
        slot_mapping: ``(T,)`` int64 cache slot of each token.
        k_cache: ``(num_blocks, block_size, kv_heads, head_dim)`` contiguous float32 keys.
        v_cache: values, same layout.

    Raises:
        RuntimeError: the kernels are unavailable, or the inputs break the layout above.
    """
    lib = _require_library()
    t, heads, dim = q.shape
    kv_heads = k.shape[1]
    f32 = torch.float32
    # Plain attribute checks: this runs once per layer and step, so no generator expressions.
    ok = (
        q.dtype is f32
        and k.dtype is f32
        and v.dtype is f32
        and cos.dtype is f32
        and sin.dtype is f32
        and k_cache.dtype is f32
        and v_cache.dtype is f32
        and q.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and q.is_contiguous()
        and k.is_contiguous()
        and v.is_contiguous()
        and cos.is_contiguous()
        and sin.is_contiguous()
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k.shape == v.shape == (t, kv_heads, dim)
        and cos.shape == sin.shape == (t, dim)
        and dim % 2 == 0
        and k_cache.shape[2:] == (kv_heads, dim)
        and v_cache.shape == k_cache.shape
        and slot_mapping.dtype is torch.int64
        and slot_mapping.is_contiguous()
        and slot_mapping.shape == (t,)
    )
    if not ok:
        raise RuntimeError(
            "rope_and_store expects contiguous float32 CPU tensors q (T, H, D), k and v "
            "(T, KVH, D), cos and sin (T, D), caches (blocks, block_size, KVH, D) and int64 "
            f"slots (T,); got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, cos "
            f"{tuple(cos.shape)}, cache {tuple(k_cache.shape)} {k_cache.dtype}"
        )
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = lib.polyrl_rope_store_f32(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slot_mapping.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        num_slots,
        t,
        heads,
        kv_heads,
        dim,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"rope_and_store got a cache slot outside [0, {num_slots})")


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``h += delta`` in place (if given), then return ``rms_norm(h) * weight``.

    Args:
        h: ``(T, N)`` contiguous float32 hidden states (updated in place with ``delta``).
        delta: ``(T, N)`` contiguous float32 residual branch output, or ``None``.
        weight: ``(N,)`` contiguous float32 norm weight.
        eps: the norm's epsilon.

    Raises:
        RuntimeError: the kernels are unavailable, or the inputs break the layout above.
    """
    lib = _require_library()
    f32 = torch.float32
    t, n = h.shape
    ok = (
        h.dtype is f32
        and weight.dtype is f32
        and h.device.type == "cpu"
        and h.is_contiguous()
        and weight.is_contiguous()
        and weight.shape == (n,)
        and (
            delta is None
            or (delta.dtype is f32 and delta.is_contiguous() and delta.shape == h.shape)
        )
    )
    if not ok:
        raise RuntimeError(
            "add_rms_norm expects contiguous float32 CPU tensors h (T, N), delta (T, N) or "
            f"None and weight (N,); got h {tuple(h.shape)} {h.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    out = torch.empty_like(h)
    lib.polyrl_add_rms_norm_f32(
        h.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        t,
        n,
        float(eps),
        torch.get_num_threads(),
    )
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one pass (the gated MLP's middle).

    Args:
        gate: contiguous float32 CPU tensor.
        up: contiguous float32 CPU tensor of the same shape.

    Raises:
        RuntimeError: the kernels are unavailable, or the inputs break the layout above.
    """
    lib = _require_library()
    f32 = torch.float32
    ok = (
        gate.dtype is f32
        and up.dtype is f32
        and gate.device.type == "cpu"
        and up.device.type == "cpu"
        and gate.is_contiguous()
        and up.is_contiguous()
        and gate.shape == up.shape
    )
    if not ok:
        raise RuntimeError(
            "silu_mul expects two contiguous float32 CPU tensors of one shape; got gate "
            f"{tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype}"
        )
    out = torch.empty_like(gate)
    lib.polyrl_silu_mul_f32(
        gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), torch.get_num_threads()
    )
    return out


def inverse_sample(
    probs: torch.Tensor, logits: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """One token per row by inversion, the same token as the sampler's torch path.

    Args:
        probs: ``(R, V)`` contiguous float32 ``softmax(logits)`` on the CPU.
        logits: ``(R, V)`` contiguous float32 logits (``-inf`` entries are never drawn).
        uniforms: ``(R,)`` contiguous float32 uniforms in ``(0, 1)``.

    Returns:
        ``(R,)`` int64 token ids.

    Raises:
        RuntimeError: the kernels are unavailable, or the inputs break the layout above.
        MemoryError: the kernel's scratch memory could not be allocated.
    """
    lib = _require_library()
    f32 = torch.float32
    rows, vocab = probs.shape
    ok = (
        probs.dtype is f32
        and logits.dtype is f32
        and uniforms.dtype is f32
        and probs.device.type == "cpu"
        and logits.device.type == "cpu"
        and uniforms.device.type == "cpu"
        and probs.is_contiguous()
        and logits.is_contiguous()
        and uniforms.is_contiguous()
        and logits.shape == probs.shape
        and uniforms.shape == (rows,)
        and vocab > 0
    )
    if not ok:
        raise RuntimeError(
            "inverse_sample expects contiguous float32 CPU tensors probs and logits (R, V) and "
            f"uniforms (R,); got probs {tuple(probs.shape)} {probs.dtype}, logits "
            f"{tuple(logits.shape)} {logits.dtype}, uniforms {tuple(uniforms.shape)}"
        )
    out = torch.empty(rows, dtype=torch.int64)
    rc = lib.polyrl_inverse_sample_f32(
        probs.data_ptr(), logits.data_ptr(), uniforms.data_ptr(), out.data_ptr(), rows, vocab
    )
    if rc != 0:
        raise MemoryError("inverse_sample could not allocate its scratch memory")
    return out
