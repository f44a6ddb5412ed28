"""Hugging Face <-> Megatron-Core GPT weight conversion (names, layouts, TP / EP shards).

Pure torch: nothing here imports Megatron, so the conversion is unit-tested without it.

Three layouts are involved:

* **HF**: the tensors of a ``transformers`` model's ``state_dict()`` (what
  :meth:`~polyrl.model_engine.engine.TrainingEngine.named_tensors` yields and ``save_pretrained``
  writes).  For ``qwen3_moe`` the in-memory experts are fused 3-D parameters
  (``mlp.experts.gate_up_proj`` ``(E, 2I, H)`` with the gate rows first, ``mlp.experts.down_proj``
  ``(E, H, I)``; transformers >= 5); checkpoints on disk hold one module per expert
  (``mlp.experts.<e>.gate_proj.weight`` ...), which :func:`fuse_hf_experts` folds into the fused
  form.
* **Megatron full**: Megatron-Core ``GPTModel`` parameter names with *unsharded* tensors, the
  embedding and output layer padded to :attr:`GPTLayout.padded_vocab_size`, expert tensors named
  by their *global* expert index.
* **Megatron shard**: what one (TP rank, EP rank) holds: :func:`shard` slices a full tensor,
  :func:`gather` joins the TP shards back; experts are renamed to their rank-local index.

Megatron layouts reproduced here (megatron-core 0.16.1, ``megatron/core/transformer``):

* ``self_attention.linear_qkv``: one column-parallel weight whose rows are grouped by query group
  (``num_query_groups`` = HF ``num_key_value_heads``): for each group, the group's query heads,
  then its key head, then its value head (``attention.py`` ``SelfAttention.get_query_key_value_
  tensors`` views the output as ``(groups, (q_per_group + 2) * head_dim)``).  Slicing dim 0 into
  TP chunks hands each rank whole groups, so ``num_key_value_heads`` must divide by TP.
* ``mlp.linear_fc1`` of a gated MLP (``gated_linear_unit``): ``[gate; up]``; under TP each rank
  holds ``[gate_r; up_r]`` (``mlp.py`` splits the local output in two with ``torch.chunk``), so
  the full tensor is not a plain dim-0 concatenation of the shards.
* Column-parallel (dim 0): ``linear_qkv`` (weight and bias), ``linear_fc1``, the word embedding
  (vocab-parallel) and ``output_layer``.  Row-parallel (dim 1): ``linear_proj``, ``linear_fc2``.
  Everything else (norms, q/k norms, the MoE router) is replicated.
* MoE experts, ``SequentialMLP`` (local spec, ``moe_grouped_gemm=False``):
  ``mlp.experts.local_experts.<j>.linear_fc{1,2}.weight``; ``TEGroupedMLP`` (TE spec with
  grouped GEMM): ``mlp.experts.linear_fc{1,2}.weight<j>``; ``j`` is the rank-local index, expert
  ``e`` lives on EP rank ``e // (E / EP)``.  Expert tensors are sliced for expert-TP (``etp``)
  like their dense counterparts.
* TransformerEngine spec: the input norm is fused into ``linear_qkv`` (``layer_norm_weight``)
  and, in dense layers, the pre-MLP norm into ``linear_fc1``; the local spec keeps
  ``input_layernorm`` / ``pre_mlp_layernorm`` modules (``fused_norms`` picks).
* Tied embeddings (``share_embeddings_and_output_weights``): no ``output_layer.weight``.

Vocab padding: ``VocabParallelEmbedding`` needs the vocabulary to divide by TP; like Megatron-LM's
``_vocab_size_with_padding`` the vocabulary is padded up to a multiple of
``make_vocab_size_divisible_by * tp`` with zero rows (:data:`DEFAULT_VOCAB_DIVISOR` = 128, the
Megatron-LM default: GEMM-friendly shapes and a no-op for Qwen's and Llama-3's vocabularies,
which already are multiples of 128).  The padded logits are not real tokens: the engine drops
them before any softmax.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "DEFAULT_VOCAB_DIVISOR",
    "SUPPORTED_ARCHS",
    "GPTLayout",
    "HFTensorPlan",
    "expert_index",
    "fuse_hf_experts",
    "gather",
    "hf_plans",
    "hf_to_megatron",
    "local_name",
    "megatron_to_hf",
    "partition_kind",
    "shard",
    "shard_state",
]

#: Megatron-LM's default ``--make-vocab-size-divisible-by``; the vocab is padded to a multiple of
#: this times TP.
DEFAULT_VOCAB_DIVISOR = 128

#: HF ``model_type`` values the converter knows.
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")


@dataclasses.dataclass(frozen=True)
class GPTLayout:
    """The shapes and naming choices that decide the conversion of one model.

    Build it from a ``transformers`` config with :meth:`from_hf_config`.
    """

    arch: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    #: Per layer: True where the MLP is a mixture of experts.
    moe_layers: tuple[bool, ...] = ()
    #: TransformerEngine spec (norms fused into linear_qkv / linear_fc1) instead of the local one.
    fused_norms: bool = False
    #: ``"sequential"`` (SequentialMLP) or ``"grouped"`` (TEGroupedMLP) expert naming.
    expert_naming: str = "sequential"
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR
    tp: int = 1
    ep: int = 1
    #: Expert tensor parallelism (Megatron's ``expert_tensor_parallel_size``).
    etp: int = 1

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r}; known: {SUPPORTED_ARCHS}")
        if self.expert_naming not in ("sequential", "grouped"):
            raise ValueError(
                f"expert_naming must be 'sequential' or 'grouped', got {self.expert_naming!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_key_value_heads % self.tp:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide by TP ({self.tp}): "
                "Megatron gives each TP rank whole query groups"
            )
        if self.ffn_hidden_size % self.tp:
            raise ValueError(f"intermediate_size must divide by TP ({self.tp})")
        if self.num_experts:
            if self.num_experts % self.ep:
                raise ValueError(f"num_experts ({self.num_experts}) must divide by EP ({self.ep})")
            if self.moe_ffn_hidden_size % self.etp:
                raise ValueError(f"moe_intermediate_size must divide by expert TP ({self.etp})")
        elif self.ep != 1:
            raise ValueError("EP > 1 needs a mixture-of-experts model")
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (bool(self.num_experts),) * self.num_layers)
        if len(self.moe_layers) != self.num_layers:
            raise ValueError("moe_layers needs one entry per layer")

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * tp``."""
        multiple = self.make_vocab_size_divisible_by * self.tp
        return -(-self.vocab_size // multiple) * multiple

    @property
    def q_per_group(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_config(cls, config: Any, **options: Any) -> GPTLayout:
        """Build the layout of a ``transformers`` config (``options``: tp, ep, naming ...)."""
        arch = config.model_type
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        num_experts = int(getattr(config, "num_experts", 0) or 0) if arch == "qwen3_moe" else 0
        moe_layers: tuple[bool, ...] = ()
        if num_experts:
            step = int(getattr(config, "decoder_sparse_step", 1) or 1)
            dense = set(getattr(config, "mlp_only_layers", None) or ())
            moe_layers = tuple(
                i not in dense and (i + 1) % step == 0 for i in range(config.num_hidden_layers)
            )
        return cls(
            arch=arch,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            num_experts=num_experts,
            moe_ffn_hidden_size=int(getattr(config, "moe_intermediate_size", 0) or 0),
            moe_layers=moe_layers,
            **options,
        )


# ---------------------------------------------------------------------------- per-tensor plans
Split = Callable[[torch.Tensor], Sequence[torch.Tensor]]
Merge = Callable[[Sequence[torch.Tensor]], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class HFTensorPlan:
    """One HF tensor and the full Megatron tensors it is split into (and merged from)."""

    hf_name: str
    sources: tuple[str, ...]
    split: Split
    merge: Merge


def _identity_split(t: torch.Tensor) -> Sequence[torch.Tensor]:
    return (t,)


def _identity_merge(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return ts[0]


def _qkv_plan(layout: GPTLayout) -> tuple[Split, Merge]:
    """Interleave q / k / v (weight or bias) into Megatron's per-query-group order and back."""
    groups, per, d = layout.num_key_value_heads, layout.q_per_group, layout.head_dim

    def split(t: torch.Tensor) -> Sequence[torch.Tensor]:
        # Input: the three HF tensors concatenated along dim 0 (see hf_plans).
        rest = t.shape[1:]
        q, k, v = torch.split(t, [groups * per * d, groups * d, groups * d])
        packed = torch.cat(
            [
                q.reshape(groups, per * d, *rest),
                k.reshape(groups, d, *rest),
                v.reshape(groups, d, *rest),
            ],
            dim=1,
        )
        return (packed.reshape(groups * (per + 2) * d, *rest),)

    def merge(ts: Sequence[torch.Tensor]) -> torch.Tensor:
        t = ts[0]
        rest = t.shape[1:]
        q, k, v = torch.split(t.reshape(groups, (per + 2) * d, *rest), [per * d, d, d], dim=1)
        return torch.cat([x.reshape(-1, *rest) for x in (q, k, v)])

    return split, merge


def _pad_vocab(layout: GPTLayout) -> tuple[Split, Merge]:
    def split(t: torch.Tensor) -> Sequence[torch.Tensor]:
        pad = layout.padded_vocab_size - t.shape[0]
        return (torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t,)

    def merge(ts: Sequence[torch.Tensor]) -> torch.Tensor:
        return ts[0][: layout.vocab_size]

    return split, merge


def _split_experts(t: torch.Tensor) -> Sequence[torch.Tensor]:
    return tuple(t.unbind(0))


def _stack_experts(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(ts))


def _expert_name(layout: GPTLayout, layer: int, fc: int, expert: int) -> str:
    """Full Megatron name of one expert's fc weight, by its *global* index."""
    base = f"decoder.layers.{layer}.mlp.experts"
    if layout.expert_naming == "grouped":
        return f"{base}.linear_fc{fc}.weight{expert}"
    return f"{base}.local_experts.{expert}.linear_fc{fc}.weight"


def hf_plans(layout: GPTLayout) -> list[HFTensorPlan]:
    """Every HF tensor of the model, in module order, with its Megatron counterparts.

    (The order is ``state_dict``'s except that a layer's q/k/v biases follow all three weights.)

    q/k/v projections map jointly: their plan is keyed by the ``q_proj`` name with
    ``hf_name`` = ``"<prefix>.qkv_proj.<weight|bias>"`` and expanded by
    :func:`hf_to_megatron` / :func:`megatron_to_hf`.  Gate/up projections likewise
    (``"<prefix>.gate_up_proj.weight"``).
    """
    plans: list[HFTensorPlan] = []
    ident = (_identity_split, _identity_merge)
    vocab = _pad_vocab(layout)
    qkv = _qkv_plan(layout)

    def add(hf: str, sources: Sequence[str], fns: tuple[Split, Merge]) -> None:
        plans.append(HFTensorPlan(hf, tuple(sources), fns[0], fns[1]))

    add("model.embed_tokens.weight", ["embedding.word_embeddings.weight"], vocab)
    for i in range(layout.num_layers):
        hf = f"model.layers.{i}"
        mc = f"decoder.layers.{i}"
        attn = f"{mc}.self_attention"
        in_norm = (
            f"{attn}.linear_qkv.layer_norm_weight"
            if layout.fused_norms
            else f"{mc}.input_layernorm.weight"
        )
        add(f"{hf}.self_attn.qkv_proj.weight", [f"{attn}.linear_qkv.weight"], qkv)
        if layout.qkv_bias:
            add(f"{hf}.self_attn.qkv_proj.bias", [f"{attn}.linear_qkv.bias"], qkv)
        add(f"{hf}.self_attn.o_proj.weight", [f"{attn}.linear_proj.weight"], ident)
        if layout.qk_norm:
            add(f"{hf}.self_attn.q_norm.weight", [f"{attn}.q_layernorm.weight"], ident)
            add(f"{hf}.self_attn.k_norm.weight", [f"{attn}.k_layernorm.weight"], ident)
        moe = layout.moe_layers[i]
        if moe:
            experts = range(layout.num_experts)
            add(
                f"{hf}.mlp.experts.gate_up_proj",
                [_expert_name(layout, i, 1, e) for e in experts],
                (_split_experts, _stack_experts),
            )
            add(
                f"{hf}.mlp.experts.down_proj",
                [_expert_name(layout, i, 2, e) for e in experts],
                (_split_experts, _stack_experts),
            )
            add(f"{hf}.mlp.gate.weight", [f"{mc}.mlp.router.weight"], ident)
        else:
            add(f"{hf}.mlp.gate_up_proj.weight", [f"{mc}.mlp.linear_fc1.weight"], ident)
            add(f"{hf}.mlp.down_proj.weight", [f"{mc}.mlp.linear_fc2.weight"], ident)
        post_norm = (
            f"{mc}.mlp.linear_fc1.layer_norm_weight"
            if layout.fused_norms and not moe
            else f"{mc}.pre_mlp_layernorm.weight"
        )
        add(f"{hf}.input_layernorm.weight", [in_norm], ident)
        add(f"{hf}.post_attention_layernorm.weight", [post_norm], ident)
    add("model.norm.weight", ["decoder.final_layernorm.weight"], ident)
    if not layout.tie_word_embeddings:
        add("lm_head.weight", ["output_layer.weight"], vocab)
    return plans


# HF names that the plans join: virtual name -> the real HF tensors, concatenated along dim 0.
_JOINED = (
    (re.compile(r"(.*)\.self_attn\.qkv_proj\.(weight|bias)$"), ("q_proj", "k_proj", "v_proj")),
    (re.compile(r"(.*)\.mlp\.gate_up_proj\.weight$"), ("gate_proj", "up_proj")),
)


def _real_names(virtual: str) -> list[str] | None:
    """Return the real HF names behind a joined plan name, or None for a plain one."""
    for pattern, parts in _JOINED:
        m = pattern.match(virtual)
        if m:
            prefix = m.group(1)
            if parts[0] == "q_proj":
                return [f"{prefix}.self_attn.{p}.{m.group(2)}" for p in parts]
            return [f"{prefix}.mlp.{p}.weight" for p in parts]
    return None


def fuse_hf_experts(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fold per-expert HF checkpoint tensors into the fused 3-D experts of transformers >= 5.

    ``mlp.experts.<e>.{gate,up,down}_proj.weight`` become ``mlp.experts.gate_up_proj`` (gate rows
    first) and ``mlp.experts.down_proj``.

    Tensors of other names pass through unchanged.
    """
    pattern = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in state.items():
        m = pattern.match(name)
        if m is None:
            out[name] = tensor
        else:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = tensor
    for prefix, by_index in experts.items():
        order = sorted(by_index)
        if order != list(range(len(order))):
            raise ValueError(f"{prefix}: expert indices are not 0..E-1: {order}")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_index[e]["gate_proj"], by_index[e]["up_proj"]]) for e in order]
        )
        out[f"{prefix}.down_proj"] = torch.stack([by_index[e]["down_proj"] for e in order])
    return out


def hf_to_megatron(
    state: Mapping[str, torch.Tensor], layout: GPTLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(megatron_name, full_tensor)`` for an HF state dict (fused or per-expert).

    ``lm_head.weight`` is ignored when the embeddings are tied (some checkpoints store it).

    Raises:
        KeyError: an HF tensor the layout needs is missing.
    """
    if any(".mlp.experts.0." in k for k in state):
        state = fuse_hf_experts(state)
    for plan in hf_plans(layout):
        real = _real_names(plan.hf_name)
        if real is None:
            tensor = state[plan.hf_name]
        else:
            tensor = torch.cat([state[n] for n in real])
        yield from zip(plan.sources, plan.split(tensor), strict=True)


def megatron_to_hf(
    get: Callable[[str], torch.Tensor], layout: GPTLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` in :func:`hf_plans` order from full Megatron tensors.

    ``get(name)`` returns one full Megatron tensor (e.g. gathered over TP on demand), so only the
    sources of one HF tensor are held at a time.
    """
    for plan in hf_plans(layout):
        merged = plan.merge([get(s) for s in plan.sources])
        real = _real_names(plan.hf_name)
        if real is None:
            yield plan.hf_name, merged
            continue
        if plan.hf_name.endswith("gate_up_proj.weight"):
            sizes = [layout.ffn_hidden_size] * 2
        else:
            d = layout.head_dim
            sizes = [
                layout.num_attention_heads * d,
                layout.num_key_value_heads * d,
                layout.num_key_value_heads * d,
            ]
        yield from zip(real, torch.split(merged, sizes), strict=True)


# ---------------------------------------------------------------------------- TP / EP shards
_EXPERT = re.compile(
    r"(.*\.mlp\.experts)\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$"
)


def partition_kind(name: str) -> str:
    """How a Megatron tensor is split over TP: ``replicated``, ``column``, ``gated`` or ``row``.

    ``gated``: a gated ``linear_fc1`` (column-parallel, ``[gate_r; up_r]`` per rank).
    """
    if name.endswith((".linear_qkv.weight", ".linear_qkv.bias")) or name in (
        "embedding.word_embeddings.weight",
        "output_layer.weight",
    ):
        return "column"
    if ".linear_fc1.weight" in name:
        return "gated"
    if ".linear_proj.weight" in name or ".linear_fc2.weight" in name:
        return "row"
    return "replicated"


def expert_index(name: str) -> tuple[str, int, str] | None:
    """``(prefix, expert index, linear_fc1|linear_fc2)`` of an expert tensor's name, else None."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    prefix = m.group(1)
    if m.group(2) is not None:
        return prefix, int(m.group(2)), m.group(3)
    return prefix, int(m.group(5)), m.group(4)


def local_name(name: str, layout: GPTLayout, ep_rank: int) -> str | None:
    """Return the name EP rank ``ep_rank`` gives a full Megatron tensor (None: not held there)."""
    found = expert_index(name)
    if found is None:
        return name
    prefix, expert, fc = found
    per_rank = layout.num_experts // layout.ep
    if expert // per_rank != ep_rank:
        return None
    j = expert % per_rank
    if layout.expert_naming == "grouped":
        return f"{prefix}.{fc}.weight{j}"
    return f"{prefix}.local_experts.{j}.{fc}.weight"


def shard(
    name: str, full: torch.Tensor, layout: GPTLayout, tp_rank: int, ep_rank: int = 0
) -> tuple[str, torch.Tensor] | None:
    """Return a rank's ``(local_name, shard)`` of a full Megatron tensor, or None if it has none.

    Expert tensors are sliced over expert-TP (``layout.etp``; the rank within it is
    ``tp_rank % etp``), all others over TP.
    """
    local = local_name(name, layout, ep_rank)
    if local is None:
        return None
    size = layout.etp if expert_index(name) is not None else layout.tp
    rank = tp_rank % size
    kind = partition_kind(name)
    if size == 1 or kind == "replicated":
        return local, full
    if kind == "column":
        return local, full.chunk(size, dim=0)[rank].contiguous()
    if kind == "row":
        return local, full.chunk(size, dim=1)[rank].contiguous()
    gate, up = full.chunk(2, dim=0)
    return local, torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]]).contiguous()


def gather(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Join the TP shards (rank order) of the Megatron tensor ``name``: :func:`shard` inverted."""
    if len(shards) == 1:
        return shards[0]
    kind = partition_kind(name)
    if kind == "replicated":
        return shards[0]
    if kind == "column":
        return torch.cat(list(shards), dim=0)
    if kind == "row":
        return torch.cat(list(shards), dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def shard_state(
    state: Mapping[str, torch.Tensor], layout: GPTLayout, tp_rank: int, ep_rank: int = 0
) -> dict[str, torch.Tensor]:
    """Return one rank's Megatron state dict (local names) from an HF state dict."""
    out = {}
    for name, full in hf_to_megatron(state, layout):
        piece = shard(name, full, layout, tp_rank, ep_rank)
        if piece is not None:
            out[piece[0]] = piece[1]
    return out
