"""Make megatron-core's GPT model run on CPU (gloo), for tests and CPU-only development.

megatron-core assumes CUDA in a handful of places on the GPT forward/backward path: it allocates
buffers with ``device=torch.cuda.current_device()`` and keeps its TP RNG states with
``torch.cuda`` RNG calls.  Nothing on that path needs a GPU otherwise (with
``use_cpu_initialization=True``, the local layer spec, fp32, no sequence parallelism and the
``allgather`` MoE token dispatcher).  Rather than copying Megatron functions to change one device
argument, :func:`apply` gives the Megatron modules listed in :data:`PATCHED_MODULES` a
module-scoped stand-in for the name ``torch``: the real :mod:`torch` in every respect except
``torch.cuda``, whose device and RNG calls answer for the CPU.  The global :mod:`torch` is not
touched, so nothing outside those modules sees a difference.

Only applied when the engine's device is CPU (:func:`apply` is a no-op on a second call), and
only for the megatron-core versions in :data:`TESTED_VERSIONS` (:func:`check_version`): the
line references below are to megatron-core 0.16.1.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

import torch

__all__ = [
    "PATCHED_MODULES",
    "TESTED_VERSIONS",
    "apply",
    "apply_without_te",
    "check_version",
    "is_applied",
]

#: megatron-core releases these patches (and the engine) were tested with.
TESTED_VERSIONS = ("0.16.1",)

#: Megatron modules whose ``torch`` global is replaced, with the CUDA uses it covers (0.16.1).
PATCHED_MODULES: dict[str, str] = {
    # RotaryEmbedding.get_emb (line 160-162) moves inv_freq to torch.cuda.current_device() on the
    # first forward: the RoPE frequency buffer.
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RoPE inv_freq buffer",
    # gather_from_sequence_parallel_region / reduce_scatter helpers (_gather_along_first_dim
    # line 91, _reduce_scatter_along_first_dim 141-181, all_to_all 442) allocate their collective
    # buffers on torch.cuda.current_device().
    "megatron.core.tensor_parallel.mappings": "collective output buffers",
    # VocabParallelEmbedding / Column- and RowParallelLinear (lines 261, 552, 597-607, 873-1218)
    # allocate weights and all-gather buffers on torch.cuda.current_device() when
    # use_cpu_initialization is off, and the linear autograd function's gather buffer always.
    "megatron.core.tensor_parallel.layers": "parallel-linear buffers",
    # gather_split_1d_tensor / split buffers (lines 70, 91).
    "megatron.core.tensor_parallel.utils": "split/gather buffers",
    # CudaRNGStatesTracker.add / fork (lines 235-238) and model_parallel_cuda_manual_seed (422)
    # seed and read torch.cuda RNG states: on CPU the TP RNG states are CPU generator states.
    "megatron.core.tensor_parallel.random": "TP RNG tracker",
    # GlobalMemoryBuffer.get_tensor (line 631) allocates attention's global memory buffer (used
    # by the local DotProductAttention's baddbmm) on torch.cuda.current_device().
    "megatron.core.utils": "global memory buffer",
    # Attention._allocate_memory (line 430): KV-cache buffers.
    "megatron.core.transformer.attention": "attention buffers",
    # DotProductAttention.__init__ (lines 123, 132): the softmax offset buffer.
    "megatron.core.transformer.dot_product_attention": "softmax offset",
    # TopKRouter.__init__ (lines 90-92) moves the router weight to torch.cuda.current_device()
    # and its aux-loss / expert-bias buffers (169-198) are allocated there.
    "megatron.core.transformer.moe.router": "MoE router",
    "megatron.core.transformer.moe.moe_utils": "MoE routing helpers",
    "megatron.core.transformer.moe.token_dispatcher": "MoE token dispatcher",
    "megatron.core.transformer.moe.experts": "MoE experts",
}

_APPLIED = False


class _CpuCuda:
    """``torch.cuda`` as seen by a patched module: device and RNG calls answer for the CPU.

    Every other attribute is the real ``torch.cuda``'s (e.g. ``torch.cuda.amp`` decorators).
    """

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def is_available(self) -> bool:
        return False

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    @property
    def random(self) -> _CpuCuda:
        return self

    @property
    def default_generators(self) -> tuple[torch.Generator, ...]:
        return (torch.default_generator,)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """The real :mod:`torch` except for ``cuda`` (:class:`_CpuCuda`)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def check_version() -> str:
    """Return the installed megatron-core version, refusing one it was not tested with.

    Raises:
        ImportError: megatron-core is missing (install ``polyrl[megatron]``).
        RuntimeError: an untested version.
    """
    try:
        from megatron.core import package_info
    except ImportError as exc:
        raise ImportError(
            "engine.backend=megatron needs megatron-core: pip install 'polyrl[megatron]' "
            "(or scripts/setup_megatron_venv.sh)"
        ) from exc
    version = package_info.__version__
    if version not in TESTED_VERSIONS:
        raise RuntimeError(
            f"megatron-core {version} is untested with polyrl's Megatron backend "
            f"(tested: {', '.join(TESTED_VERSIONS)}); its CPU patches and converter names are "
            "written against those releases"
        )
    return version


def _set_rng_state_cpu(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    # tensor_parallel.random._set_cuda_rng_state (0.16.1 lines 72-110) sets the state through
    # torch.cuda.default_generators via torch.cuda._lazy_call, which fails without CUDA; the
    # tracker's fork() calls it to switch RNG states, here the CPU generator's.
    torch.set_rng_state(new_state)


def _get_rng_state_cpu(device: Any = None, clone: bool = False, graph_safe: bool = False):
    # tensor_parallel.random._get_cuda_rng_state (0.16.1 lines 41-70): the CPU generator's state.
    return torch.get_rng_state()


def _causal_mask_cpu(sq: int) -> torch.Tensor:
    # transformer/utils.py get_default_causal_mask (0.16.1 line 33-35) builds the mask with the
    # literal device="cuda" (not through torch.cuda), so the torch stand-in cannot reach it;
    # fusions/fused_softmax.py FusedScaleMaskSoftmax.forward_torch_softmax (line 327) calls it
    # when attention_mask is None (the default causal mask).  True above the diagonal = masked.
    return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)


def apply() -> None:
    """Patch the modules of :data:`PATCHED_MODULES` for CPU (idempotent).

    Call before building a Megatron model on CPU; never on a CUDA device.
    """
    global _APPLIED
    if _APPLIED:
        return
    check_version()
    stand_in = _TorchOnCpu()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        module.torch = stand_in
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._set_cuda_rng_state = _set_rng_state_cpu
    random._get_cuda_rng_state = _get_rng_state_cpu
    softmax = importlib.import_module("megatron.core.fusions.fused_softmax")
    softmax.get_default_causal_mask = _causal_mask_cpu
    apply_without_te()
    _APPLIED = True


def apply_without_te() -> None:
    """Fix megatron-core's MoE router gating when TransformerEngine is absent (CPU or GPU).

    transformer/moe/moe_utils.py (0.16.1) binds ``te_general_gemm`` only when
    ``import transformer_engine`` succeeds (lines 22-39) but
    ``RouterGatingLinearFunction.forward`` / ``backward`` (lines 1192, 1225) test
    ``te_general_gemm is not None`` unconditionally: a NameError without TE.  Binding it to None
    selects the plain ``torch.mm`` path those lines already have.
    """
    check_version()
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def is_applied() -> bool:
    """Whether :func:`apply` ran in this process."""
    return _APPLIED
