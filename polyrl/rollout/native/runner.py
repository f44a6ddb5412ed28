"""The model side of the native engine: a HF causal LM run on packed batches, and its weights.

:class:`ModelRunner` loads any local HF causal LM whose attention goes through transformers'
``AttentionInterface`` (Llama, Qwen2/3, Qwen3-MoE, Mistral, ...), switches it to the paged
attention of :mod:`polyrl.rollout.native.attention`, and runs one packed forward per engine
step. It also owns the weights: validating and staging new ones, copying them in, and
releasing/restoring them for sleep.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from polyrl.core.arena import SharedArena
from polyrl.core.cuda import HostStash
from polyrl.core.dtypes import dtype_name, resolve_dtype
from polyrl.core.errors import WeightTransferError
from polyrl.core.rollout_api import InvalidRequestError
from polyrl.models.loader import load_causal_lm
from polyrl.models.moe import moe_routers
from polyrl.models.vision_family import VisionFamily, vision_family
from polyrl.rollout.native.attention import ATTENTION_NAME, StepMetadata
from polyrl.rollout.native.fast_forward import FastForward, build_fast_forward
from polyrl.rollout.native.media import EmbeddingCache, MediaItem
from polyrl.rollout.native.routes import RouteRecorder

__all__ = ["ModelRunner", "StepInputs"]


@dataclasses.dataclass
class StepInputs:
    """Tensors of one packed forward.

    Attributes:
        input_ids: ``(1, T)`` new tokens of all scheduled sequences, decode tokens first.
        position_ids: ``(1, T)`` their positions within their own sequences.
        logits_index: ``(S,)`` packed index of each token whose next-token logits are needed.
        meta: paged-attention metadata (slots, block tables, masks).
        mrope_positions: ``(3, 1, T)`` multi-modal rotary positions (vision models only).
        media: ``(packed start, item, first row, end row)``: rows of an item's embeddings
            that go at packed positions from ``packed start`` on (vision models only).
        score_spans: prompt positions scored this step (prompt log-probs):
            ``(sequence, first position, count, first row)``; their logits rows follow the
            sampling rows in ``logits_index``, from ``first row`` on.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logits_index: torch.Tensor
    meta: StepMetadata
    mrope_positions: torch.Tensor | None = None
    media: list[tuple[int, MediaItem, int, int]] = dataclasses.field(default_factory=list)
    score_spans: list[tuple[Any, int, int, int]] = dataclasses.field(default_factory=list)


def _model_geometry(config: object) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a HF text config."""
    text = getattr(config, "get_text_config", lambda: config)()
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    if layers is None or heads is None:
        raise ValueError(
            f"model config {type(config).__name__} lacks num_hidden_layers/num_attention_heads; "
            "the native rollout engine serves decoder-only causal LMs"
        )
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return int(layers), int(kv_heads), int(head_dim)


class ModelRunner:
    """A HF causal LM prepared for packed paged-attention forwards.

    Args:
        model_dir: local HF model directory.
        dtype: parameter dtype name or torch dtype.
        device: ``cpu`` or ``cuda[:i]``.
        trust_remote_code: allow code shipped with the model.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        trust_remote_code: bool = False,
    ):
        self.model_dir = str(model_dir)
        self.dtype = resolve_dtype(dtype)
        self.trust_remote_code = trust_remote_code
        model = load_causal_lm(model_dir, self.dtype, device, trust_remote_code)
        model.eval()
        model.requires_grad_(False)
        model.set_attn_implementation(ATTENTION_NAME)
        #: A vision model's family rules (``None``: a text model).
        self.family: VisionFamily | None = vision_family(model.config)
        #: Whether the model has a vision tower (it then runs with inputs_embeds).
        self.vision = self.family is not None
        if self.vision:
            # The vision tower attends within each image, with no KV cache: it keeps SDPA.
            model.config.vision_config._attn_implementation = "sdpa"
        #: Token ids a vision model must never sample: its media placeholders and markers.
        self.media_token_ids: tuple[int, ...] = (
            self.family.suppressed_ids if self.family is not None else ()
        )
        #: Vision-tower outputs by item, cleared by every weight change.
        self.embedding_cache = EmbeddingCache()
        #: How many times the vision tower ran (one item per call).
        self.vision_calls = 0
        self.model = model
        self.device = next(model.parameters()).device
        self.config = model.config
        self.num_layers, self.num_kv_heads, self.head_dim = _model_geometry(model.config)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        # Every name a parameter answers to (tied weights answer to both of theirs).
        self._params: dict[str, torch.nn.Parameter] = dict(
            model.named_parameters(remove_duplicate=False)
        )
        self._unique_names = [n for n, _ in model.named_parameters()]
        self._offloaded: dict[str, torch.Tensor] | None = None
        # Host copies for sleep level 1, pinned on CUDA and reused by every sleep.
        self._stash = HostStash(pin=self.device.type == "cuda")
        # Shapes of discarded parameters (sleep level 2), by id of the parameter.
        self._shapes: dict[int, tuple[int, ...]] = {}
        # ... and their storage's address alignment (mod 64), which new storage copies.
        self._aligns: dict[int, int] = {}
        self.weights_discarded = False
        # The engine's own packed forward (set by enable_fast_forward), else the HF forward.
        self.fast: FastForward | None = None
        # MoE models: records the experts chosen in a step, for requests that ask for them.
        self.routes: RouteRecorder | None = RouteRecorder(model) if moe_routers(model) else None
        # Shared arenas holding shadows (or, after a swap, live weights) that same-host senders
        # write into directly; pruned once no parameter or shadow lies in them.
        self._arenas: list[SharedArena] = []

    def enable_fast_forward(
        self, enabled: bool = True, matmul_dtype: str | torch.dtype | None = None
    ) -> bool:
        """Use the packed forward of :mod:`.fast_forward` where the model allows it.

        Args:
            enabled: use it (``False`` goes back to the HF forward).
            matmul_dtype: dtype of the decoder layers' projection matmuls in the fast forward
                (``None``: the weights' dtype).

        Returns:
            Whether the fast forward is now in use.
        """
        low = None if matmul_dtype is None else resolve_dtype(matmul_dtype)
        # The fast forward knows text decoders only; a vision model keeps the HF forward.
        self.fast = build_fast_forward(self.model, low) if enabled and not self.vision else None
        return self.fast is not None

    def mark_weights_changed(self) -> None:
        """Note that parameter values or storage changed (drops weight copies derived from them).

        Every method here that changes the weights calls it; the engine calls it when a
        streamed in-place update, whose bytes land in the live parameters, commits or aborts.
        """
        if self.fast is not None:
            self.fast.invalidate()
        # Image embeddings were computed by the old vision weights.
        self.embedding_cache.clear()

    @property
    def offloaded(self) -> bool:
        """Whether the weights sit in host memory (sleep level 1 on an accelerator)."""
        return self._offloaded is not None

    @property
    def weight_bytes(self) -> int:
        """Bytes of parameters now held on the model's device."""
        if self.weights_discarded or self._offloaded is not None:
            return 0
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Run one packed step; return ``(S, vocab)`` logits of the requested positions."""
        if self.fast is not None:
            return self.fast(
                inputs.input_ids[0], inputs.position_ids[0], inputs.logits_index, inputs.meta
            )
        if self.vision:
            return self._forward_vision(inputs)
        out = self.model(
            input_ids=inputs.input_ids,
            position_ids=inputs.position_ids,
            use_cache=False,
            logits_to_keep=inputs.logits_index,
            polyrl_step=inputs.meta,
        )
        return out.logits[0]

    def token_ids(self) -> dict[str, int]:
        """Return the placeholder token id by media kind (vision models)."""
        return dict(self.family.token_ids) if self.family is not None else {}

    @torch.inference_mode()
    def encode_item(self, item: MediaItem) -> torch.Tensor:
        """Run the vision tower on one image or video; return its ``(tokens, hidden)`` rows."""
        tensors = {
            k: v.to(self.device, self.dtype if v.is_floating_point() else v.dtype)
            for k, v in item.tensors.items()
        }
        emb = self.family.encode_item(self.model, item.kind, tensors)
        self.vision_calls += 1
        if emb.shape[0] != item.length:
            raise InvalidRequestError(
                f"the {item.kind} fills {item.length} tokens but the vision tower gave "
                f"{emb.shape[0]} embeddings",
                param="multi_modal",
            )
        return emb

    def _forward_vision(self, inputs: StepInputs) -> torch.Tensor:
        ids = inputs.input_ids
        embeds = self.model.get_input_embeddings()(ids)
        layers = self.family.deepstack_layers
        # DeepStack families: per packed position, each layer's feature (zero off media rows).
        stacked = embeds.new_zeros(layers, ids.shape[1], embeds.shape[-1]) if layers else None
        visual = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device) if layers else None
        for at, item, lo, hi in inputs.media:
            emb = self.embedding_cache.get(item, self.encode_item)
            # Only the rows of this chunk: a prefill chunk may cut an image's run.
            rows = emb[lo:hi].to(embeds.dtype)
            if stacked is None:
                embeds[0, at : at + hi - lo] = rows
                continue
            embeds[0, at : at + hi - lo] = rows[:, 0]
            stacked[:, at : at + hi - lo] = rows[:, 1:].transpose(0, 1)
            visual[0, at : at + hi - lo] = True
        positions = inputs.position_ids
        if self.family.mrope:
            mrope = inputs.mrope_positions
            if mrope is None:
                mrope = inputs.position_ids.view(1, 1, -1).expand(3, 1, -1)
            # Packed layout the HF model reads: text positions first, then (t, h, w).
            positions = torch.cat([inputs.position_ids.view(1, 1, -1), mrope], dim=0)
        deepstack = None
        if stacked is not None and bool(visual.any()):
            # The model adds features in the order of the mask's True positions.
            deepstack = (visual, stacked[:, visual[0]])
        return self.family.forward_embeds(
            self.model,
            embeds,
            positions,
            inputs.logits_index,
            deepstack=deepstack,
            polyrl_step=inputs.meta,
        )

    # ----------------------------------------------------------------------------- weights

    def stage_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False
    ) -> dict[str, torch.Tensor]:
        """Check new weights against the model and copy them to its device and dtype.

        Args:
            named_tensors: ``(name, tensor)`` pairs named like ``model.named_parameters()``.
            partial: accept a subset of the parameters (others keep their values).

        Returns:
            Staged tensors by parameter name, ready for :meth:`apply_weights`.

        Raises:
            InvalidRequestError: unknown name, wrong shape, non-tensor, or (unless ``partial``)
                a missing parameter.
        """
        staged: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors:
            param = self._params.get(name)
            if param is None:
                close = [n for n in self._unique_names if n.endswith(name.split(".")[-1])][:3]
                raise InvalidRequestError(
                    f"weight {name!r} is not a parameter of {type(self.model).__name__}; "
                    f"expected names as in model.named_parameters() (e.g. {close})",
                    param="weights",
                )
            if not isinstance(tensor, torch.Tensor):
                raise InvalidRequestError(
                    f"weight {name!r} is a {type(tensor).__name__}, expected a torch.Tensor",
                    param="weights",
                )
            expected = self._shapes.get(id(param), tuple(param.shape))
            if tuple(tensor.shape) != expected:
                raise InvalidRequestError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects "
                    f"{expected}",
                    param="weights",
                )
            if not tensor.is_floating_point():
                raise InvalidRequestError(
                    f"weight {name!r} has dtype {tensor.dtype}; expected a floating point tensor",
                    param="weights",
                )
            # One copy, into the parameter's reusable shadow (see :meth:`swap_in`).
            shadow = self.shadow(name)
            shadow.copy_(tensor.detach())
            staged[name] = shadow
        if not partial:
            covered = {id(self._params[n]) for n in staged}
            missing = [n for n in self._unique_names if id(self._params[n]) not in covered]
            if missing:
                raise InvalidRequestError(
                    f"{len(missing)} parameter(s) missing from the new weights, e.g. "
                    f"{missing[:3]}; send every parameter or use partial=True",
                    param="weights",
                )
        if not staged:
            raise InvalidRequestError("no weights were given", param="weights")
        return staged

    @torch.inference_mode()
    def apply_weights(self, staged: dict[str, torch.Tensor]) -> None:
        """Switch to staged tensors (call between steps only).

        Shadows (from :meth:`shadow`) are swapped in without a copy; other tensors are copied.
        """
        shadows = self._shadow_map()
        if all(shadows.get(id(self._params[n])) is t for n, t in staged.items()):
            self.swap_in(list(staged))
            return
        if self.weights_discarded:
            self._restore_storage()
            self.weights_discarded = False
        for name, tensor in staged.items():
            self._params[name].data.copy_(tensor)
        self.mark_weights_changed()

    # Shadows: one reusable buffer per parameter that receives the next weights while the
    # current ones keep serving; the switch swaps storage pointers, and the old storage becomes
    # the next update's shadow. Costs one model of memory, allocated on the first update.

    def _shadow_map(self) -> dict[int, torch.Tensor]:
        return self.__dict__.setdefault("_shadows", {})

    def expected_shape(self, name: str) -> tuple[int, ...]:
        """Shape the model expects for parameter ``name`` (even while its weights are dropped).

        Raises:
            InvalidRequestError: ``name`` is not a parameter of the model.
        """
        param = self._params.get(name)
        if param is None:
            close = [n for n in self._unique_names if n.endswith(name.split(".")[-1])][:3]
            raise InvalidRequestError(
                f"weight {name!r} is not a parameter of {type(self.model).__name__}; "
                f"expected names as in model.named_parameters() (e.g. {close})",
                param="weights",
            )
        return self._shapes.get(id(param), tuple(param.shape))

    def shadow(self, name: str) -> torch.Tensor:
        """Return the reusable shadow buffer of parameter ``name`` (allocated on first use)."""
        shape = self.expected_shape(name)
        param = self._params[name]
        shadows = self._shadow_map()
        buf = shadows.get(id(param))
        if buf is None or tuple(buf.shape) != shape:
            buf = shadows[id(param)] = self._aligned_like(param, shape)
        return buf

    def _alignment(self, param: torch.nn.Parameter) -> int:
        """Address alignment (mod 64) of ``param``'s storage, or of its dropped storage."""
        live = param.data
        if live.numel():
            return live.data_ptr() % 64
        return self._aligns.get(id(param), 0)

    def _aligned_like(self, param: torch.nn.Parameter, shape: tuple[int, ...]) -> torch.Tensor:
        # CPU kernels pick code paths by address alignment, and fp32 results differ in the
        # last bits between them: give new storage the live storage's alignment (mod 64), so a
        # replica computes bit for bit what a replica freshly loaded with the same weights does.
        size = param.element_size()
        numel = 1
        for d in shape:
            numel *= d
        raw = torch.empty(numel * size + 64, dtype=torch.uint8, device=self.device)
        skip = (self._alignment(param) - raw.data_ptr()) % 64
        return raw[skip : skip + numel * size].view(param.dtype).view(shape)

    def shared_shadows(self) -> dict[str, object] | None:
        """Put the shadows in one shared arena and describe it for a same-host sender.

        Returns ``{"path", "size", "tensors": {name: [offset, shape, dtype]}}`` (every name a
        parameter answers to, tied aliases included), or ``None`` where direct writes cannot
        work: weights on an accelerator, offloaded or discarded, or no room in ``/dev/shm``.
        The shadows are reused when they already lie in one arena (every update after the
        second, once the two arenas alternate as live and shadow storage); otherwise they are
        replaced by a new arena (the old shadows are freed first, so memory stays at one model
        of shadows).
        """
        if self.device.type != "cpu" or self._offloaded is not None or self.weights_discarded:
            return None
        shadows = self._shadow_map()
        unique = [self._params[n] for n in self._unique_names]
        current = [shadows.get(id(p)) for p in unique]
        # Empty tensors have no address to place: they never decide which arena is in use.
        sized = [s for s in current if s is not None and s.numel()]
        arena = next((a for a in self._arenas if sized and a.contains(sized[0])), None)
        if arena is None or not all(
            s is not None
            and tuple(s.shape) == tuple(p.shape)
            and (arena.contains(s) or not s.numel())
            for s, p in zip(current, unique, strict=True)
        ):
            arena = self._new_shadow_arena(unique)
            if arena is None:
                return None
        by_id = {}
        for param in unique:
            shadow = shadows[id(param)]
            by_id[id(param)] = [
                arena.offset_of(shadow) if shadow.numel() else 0,
                list(shadow.shape),
                dtype_name(shadow.dtype),
            ]
        return {
            "path": str(arena.path),
            "size": arena.nbytes,
            "tensors": {name: by_id[id(p)] for name, p in self._params.items()},
        }

    def _new_shadow_arena(self, unique: list[torch.nn.Parameter]) -> SharedArena | None:
        self.release_shadows()  # the old shadows go before the arena comes: one model at most
        layout = []
        offset = 0
        for param in unique:
            # Same address alignment (mod 64) as the live storage: see _aligned_like.
            offset += (self._alignment(param) - offset) % 64
            layout.append(offset)
            offset += param.numel() * param.element_size()
        try:
            arena = SharedArena(offset)
        except WeightTransferError:
            return None
        self._arenas.append(arena)
        shadows = self._shadow_map()
        for param, start in zip(unique, layout, strict=True):
            shadows[id(param)] = arena.view(start, tuple(param.shape), param.dtype)
        return arena

    def _prune_arenas(self) -> None:
        """Unlink arenas no parameter or shadow lies in any more (their memory goes with them)."""
        if not self._arenas:
            return
        held = [p.data for p in self._params.values()] + list(self._shadow_map().values())
        keep = []
        for arena in self._arenas:
            if any(arena.contains(t) for t in held if t.numel()):
                keep.append(arena)
            else:
                arena.unlink()
        self._arenas = keep

    def live(self, name: str) -> torch.Tensor:
        """Return the serving storage of parameter ``name`` (in-place loading, engine paused)."""
        if self._offloaded is not None:
            raise InvalidRequestError(
                "the weights are offloaded (sleep level 1); wake_up(tags=['weights']) before an "
                "in-place weight update",
                param="weights",
            )
        if self.weights_discarded:
            self._restore_storage()
            self.weights_discarded = False
        self.expected_shape(name)
        return self._params[name].data

    @property
    def shadow_bytes(self) -> int:
        """Bytes held by shadows (the staged mode's extra model copy)."""
        return sum(t.numel() * t.element_size() for t in self._shadow_map().values())

    def release_shadows(self) -> int:
        """Free the shadows; returns the bytes released."""
        freed = self.shadow_bytes
        self._shadow_map().clear()
        self._prune_arenas()
        return freed

    @torch.inference_mode()
    def swap_in(self, names: Iterable[str]) -> None:
        """Make the shadows of ``names`` the parameters; call between steps only."""
        if self._offloaded is not None:
            raise InvalidRequestError(
                "the weights are offloaded (sleep level 1); wake_up(tags=['weights']) first",
                param="weights",
            )
        shadows = self._shadow_map()
        params = {id(self._params[n]): self._params[n] for n in names}
        for key, param in params.items():
            new = shadows[key]
            old = param.data
            param.data = new
            if tuple(old.shape) == tuple(new.shape):
                shadows[key] = old
            else:  # a dropped (sleep level 2) placeholder: no use as a shadow
                del shadows[key]
        if self.weights_discarded:
            if len(params) != len({id(p) for p in self._params.values()}):
                raise InvalidRequestError(
                    "the weights were discarded; a partial update cannot restore them",
                    param="weights",
                )
            self._shapes = {}
            self._aligns = {}
            self.weights_discarded = False
        self._prune_arenas()
        self.mark_weights_changed()

    def load_dir(self, path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
        """Read and stage all weights of a HF model directory (safetensors or ``.bin``).

        The directory is loaded with the same model class as the served model, so checkpoint
        key conversions (fused MoE experts, renamed keys) apply exactly as at start-up.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise InvalidRequestError(
                f"weights path {str(path)!r} is not a directory; expected a Hugging Face model "
                "directory with safetensors files",
                param="path",
            )
        if not any(directory.glob("*.safetensors")):
            raise InvalidRequestError(
                f"weights directory {str(path)!r} has no *.safetensors file", param="path"
            )
        try:
            source = load_causal_lm(directory, self.dtype, "cpu", self.trust_remote_code)
        except (OSError, ValueError) as exc:
            raise InvalidRequestError(
                f"cannot load weights from {str(path)!r}: {exc}", param="path"
            ) from exc
        if type(source) is not type(self.model):
            raise InvalidRequestError(
                f"weights in {str(path)!r} are for {type(source).__name__}, the served model is "
                f"{type(self.model).__name__}",
                param="path",
            )
        return self.stage_weights(source.named_parameters())

    # ------------------------------------------------------------------------------- sleep

    def offload(self) -> int:
        """Move weights to host memory (sleep level 1); returns bytes freed on the device.

        On a CPU device there is nothing to free and the weights stay where they are.
        """
        if self.device.type == "cpu" or self._offloaded is not None or self.weights_discarded:
            return 0
        freed = self.weight_bytes + self.release_shadows()
        self._offloaded = {}
        for name in self._unique_names:
            param = self._params[name]
            self._offloaded[name] = self._stash.save(name, param.data)
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        torch.cuda.synchronize(self.device)  # the copies are asynchronous into pinned memory
        self.mark_weights_changed()
        torch.cuda.empty_cache()
        return freed

    def discard(self) -> int:
        """Drop the weights entirely (sleep level 2); returns bytes freed.

        New weights must be loaded (``update_weights``) before the next forward.
        """
        if self.weights_discarded:
            return 0
        freed = sum(p.numel() * p.element_size() for p in self.model.parameters())
        freed += self.release_shadows()
        self._offloaded = None
        self._shapes = {id(p): tuple(p.shape) for p in self._params.values()}
        self._aligns = {id(p): self._alignment(p) for p in self._params.values()}
        for name in self._unique_names:
            param = self._params[name]
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        self.weights_discarded = True
        self._prune_arenas()
        self.mark_weights_changed()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def _restore_storage(self) -> None:
        for name in self._unique_names:
            param = self._params[name]
            param.data = self._aligned_like(param, self._shapes[id(param)])
        self._shapes = {}
        self._aligns = {}

    def reload(self) -> None:
        """Bring offloaded weights back to the device (wake-up after sleep level 1)."""
        if self._offloaded is None:
            return
        for name in self._offloaded:
            self._params[name].data = self._stash.load(name, self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._offloaded = None
        self.mark_weights_changed()
