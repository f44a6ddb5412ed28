"""What differs between vision-language model families, in one place.

The processor, the model engine and the native rollout engine handle every VLM the same way
(images decoded once, processed inputs travelling with the prompt, placeholders expanded, image
embeddings placed at the image tokens). What a family decides is collected in a
:class:`VisionFamily`:

* its placeholder token ids and what one placeholder expands to
  (:meth:`VisionFamily.process_images`);
* which rows of the processed tensors belong to one item (:meth:`VisionFamily.split_items`)
  and how the vision tower turns them into that item's embeddings
  (:meth:`VisionFamily.encode_item`);
* the tensors the Hugging Face forward takes (:meth:`VisionFamily.forward_media`);
* positions: multi-modal rotary (M-RoPE) or the plain 1-D ones
  (:meth:`VisionFamily.positions`);
* which modules are the vision tower (freezing, LoRA exclusion, FSDP units).

Two families are implemented: Qwen2-VL (``qwen2_vl``, and ``qwen2_5_vl`` and ``qwen3_vl`` for
images: a patch-merging ViT, M-RoPE, one placeholder run per image; Qwen3-VL adds DeepStack
features, see :class:`Qwen3VLFamily`) and SmolVLM (``smolvlm``, transformers'
``SmolVLMForConditionalGeneration``, the Idefics3 layout: a SigLIP tower plus a pixel-shuffle
connector, a Llama text model with 1-D positions, an image split into tiles each wrapped in
marker tokens). :func:`vision_family` picks one from a model's config.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from polyrl.core.multimodal import MultiModalInputError, MultiModalInputs, mrope_positions

__all__ = [
    "VISION_FAMILIES",
    "Qwen25VLFamily",
    "Qwen2VLFamily",
    "Qwen3VLFamily",
    "SmolVLMFamily",
    "VisionFamily",
    "vision_family",
]


def _get(config: Any, name: str, default: Any = None) -> Any:
    """Read a config field from a ``PretrainedConfig`` or a ``config.json`` dict."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    """Return ``model``'s submodule at dotted ``path``, or ``None`` when it has none."""
    node: Any = model
    for part in path.split("."):
        node = getattr(node, part, None)
        if not isinstance(node, nn.Module):
            return None
    return node


def _vision_output(out: Any) -> torch.Tensor:
    """Return the tensor a vision tower gave (transformers 5 wraps it in a model output)."""
    if isinstance(out, torch.Tensor):
        return out
    for name in ("pooler_output", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"unexpected vision tower output {type(out).__name__}")


class VisionFamily(abc.ABC):
    """The family-specific parts of a vision-language model (see the module docstring).

    Args:
        config: the model's config (``PretrainedConfig`` or the ``config.json`` dict).

    Attributes:
        model_type: the config's ``model_type``.
        token_ids: placeholder token id by media kind.
        mrope: whether the family uses multi-modal rotary positions (else 1-D positions).
        tower_paths: dotted paths (from the causal LM wrapper) of the vision modules: the
            vision encoder and its projection into the language model.
    """

    model_types: tuple[str, ...] = ()
    mrope: bool = False
    tower_paths: tuple[str, ...] = ()
    #: Decoder layers that take DeepStack features (0: the family has none).
    deepstack_layers: int = 0

    def __init__(self, config: Any):
        self.model_type = str(_get(config, "model_type"))
        self.vision_config = _get(config, "vision_config") or {}
        self.token_ids: dict[str, int] = {"image": int(_get(config, "image_token_id"))}

    # -------------------------------------------------------------------- processor side

    @abc.abstractmethod
    def resize_kwargs(
        self, image_processor: Any, min_pixels: int | None, max_pixels: int | None
    ) -> dict[str, Any]:
        """Return the image processor's call arguments that apply ``data.image_*_pixels``."""

    @abc.abstractmethod
    def process_images(
        self, image_processor: Any, tokenizer: Any, images: Sequence[Any], resize: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], list[int], list[tuple[int, ...]] | None]:
        """Process decoded images.

        Returns:
            ``(tensors, embedding tokens per image, expansion per image)``; the expansions
            are ``None`` when each placeholder becomes one run of placeholder tokens.
        """

    def process_videos(
        self, image_processor: Any, clips: Sequence[Sequence[Any]], resize: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Process decoded videos (frame lists); families without videos refuse them."""
        raise MultiModalInputError(
            f"{self.model_type} models take images only in polyrl; send the frames as images"
        )

    @abc.abstractmethod
    def media_order(self, ids: Sequence[int]) -> list[str]:
        """Return the kinds of the items whose placeholders (or expansions) ``ids`` holds."""

    # ------------------------------------------------------------------------ model side

    @property
    def suppressed_ids(self) -> tuple[int, ...]:
        """Token ids a sampler must never draw (a drawn placeholder would read no image)."""
        return tuple(sorted(set(self.token_ids.values())))

    def positions(
        self, ids: Sequence[int] | torch.Tensor, inputs: MultiModalInputs | None
    ) -> tuple[torch.Tensor, int] | None:
        """Return a sequence's ``(3, len)`` M-RoPE positions and delta; ``None``: 1-D positions."""
        return None

    @abc.abstractmethod
    def split_items(self, inputs: MultiModalInputs) -> list[tuple[dict[str, torch.Tensor], str]]:
        """Return, per item in prompt order, the tensors that encode it alone and a shape key.

        The shape key tells apart the same picture processed to another layout (cache keys).

        Raises:
            MultiModalInputError: the tensors do not hold the items.
        """

    @abc.abstractmethod
    def encode_item(self, model: nn.Module, kind: str, tensors: dict[str, torch.Tensor]):
        """Run the vision tower on one item's tensors; return its ``(tokens, hidden)`` rows.

        DeepStack families (``deepstack_layers > 0``) return ``(tokens, 1 + layers, hidden)``:
        the input embedding, then each layer's DeepStack feature.
        """

    def forward_media(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return the arguments the Hugging Face forward takes for joined media tensors.

        Items must come out of the model's feature method one entry per item (so that the
        engine can repeat an item for the samples sharing it).
        """
        return dict(tensors)

    def forward_embeds(
        self,
        model: nn.Module,
        embeds: torch.Tensor,
        position_ids: torch.Tensor,
        logits_index: torch.Tensor,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Run the model on a packed step's input embeddings; return ``(S, vocab)`` logits.

        Args:
            model: the causal LM wrapper.
            embeds: ``(1, T, hidden)`` input embeddings, media rows filled in.
            position_ids: ``(1, T)`` positions, or ``(4, 1, T)`` for M-RoPE families.
            logits_index: ``(S,)`` packed index of the tokens whose logits are wanted.
            deepstack: DeepStack families only: ``(visual mask (1, T), features (layers,
                visual tokens, hidden))`` (see :class:`Qwen3VLFamily`).
            **kwargs: passed to the forward (the attention backend's step metadata).
        """
        out = model(
            inputs_embeds=embeds,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=logits_index,
            **kwargs,
        )
        return out.logits[0]

    @abc.abstractmethod
    def dummy_features(self, model: nn.Module, device: torch.device) -> torch.Tensor:
        """Run the vision tower (and its projection) once on a minimal dummy input."""

    def tower_modules(self, model: nn.Module) -> list[nn.Module]:
        """Return the vision modules of ``model`` (empty when it has none)."""
        found = [_submodule(model, p) for p in self.tower_paths]
        return [m for m in found if m is not None]

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        """Vision modules that become FSDP units besides the model's no-split blocks."""
        return []

    def in_tower(self, name: str) -> bool:
        """Whether a module or parameter name lies in the vision tower."""
        return any(name == p or name.startswith(p + ".") for p in self.tower_paths)

    @property
    def tower_regex(self) -> str:
        """A regular expression matching the vision modules' names (PEFT's exclusion)."""
        return "|".join(p.replace(".", r"\.") + r"(\..*)?" for p in self.tower_paths)


class Qwen2VLFamily(VisionFamily):
    """Qwen2-VL and Qwen2.5-VL: patch-merging ViT, M-RoPE, one placeholder run per item."""

    model_types = ("qwen2_vl",)
    mrope = True
    tower_paths = ("model.visual",)
    #: The processor's pixel tensor and grid of each kind of item.
    TENSORS = {
        "image": ("pixel_values", "image_grid_thw"),
        "video": ("pixel_values_videos", "video_grid_thw"),
    }

    def __init__(self, config: Any):
        super().__init__(config)
        self.token_ids["video"] = int(_get(config, "video_token_id"))
        self.markers = tuple(
            int(t)
            for t in (_get(config, "vision_start_token_id"), _get(config, "vision_end_token_id"))
            if t is not None
        )
        vision = self.vision_config
        self.merge_size = int(_get(vision, "spatial_merge_size", 2))
        self.temporal_patch_size = int(_get(vision, "temporal_patch_size", 2) or 1)
        channels = int(_get(vision, "in_channels", _get(vision, "in_chans", 3)))
        patch = int(_get(vision, "patch_size", 14))
        self.patch_dim = channels * self.temporal_patch_size * patch * patch

    @property
    def suppressed_ids(self) -> tuple[int, ...]:
        """The placeholders and the vision start/end markers."""
        return tuple(sorted({*self.token_ids.values(), *self.markers}))

    def resize_kwargs(
        self, image_processor: Any, min_pixels: int | None, max_pixels: int | None
    ) -> dict[str, Any]:
        """Qwen2-VL's processor bounds an image's area directly (``shortest/longest_edge``)."""
        size = dict(getattr(image_processor, "size", {}) or {})
        low = int(min_pixels or size.get("shortest_edge") or 56 * 56)
        high = int(max_pixels or size.get("longest_edge") or 28 * 28 * 1280)
        if low > high:
            raise ValueError(f"image_min_pixels ({low}) is larger than image_max_pixels ({high})")
        return {"size": {"shortest_edge": low, "longest_edge": high}}

    def _pixels(
        self, image_processor: Any, images: Sequence[Any], resize: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = image_processor(images=list(images), return_tensors="pt", **resize)
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def process_images(
        self, image_processor: Any, tokenizer: Any, images: Sequence[Any], resize: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], list[int], list[tuple[int, ...]] | None]:
        """One run of ``t*h*w / merge**2`` image tokens per image."""
        pixels, grids = self._pixels(image_processor, images, resize)
        counts = [int(g.prod()) // self.merge_size**2 for g in grids]
        return {"pixel_values": pixels, "image_grid_thw": grids}, counts, None

    def process_videos(
        self, image_processor: Any, clips: Sequence[Sequence[Any]], resize: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Every frame through the image processor, consecutive frames paired in time."""
        parts = [self._video_pixels(image_processor, c, resize) for c in clips]
        grids = torch.cat([g for _, g in parts])
        counts = [int(g.prod()) // self.merge_size**2 for _, g in parts]
        return {"pixel_values_videos": torch.cat([p for p, _ in parts]), "video_grid_thw": grids}, (
            counts
        )

    def _video_pixels(
        self, image_processor: Any, frames: Sequence[Any], resize: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Same resize for all frames (the first frame's size), then consecutive frames are
        # paired into temporal patches.
        size = frames[0].size
        frames = [f if f.size == size else f.resize(size) for f in frames]
        tp = self.temporal_patch_size
        if len(frames) % tp:
            frames = [*frames, *([frames[-1]] * (tp - len(frames) % tp))]
        pixels, grids = self._pixels(image_processor, frames, resize)
        _, gh, gw = grids[0].tolist()
        n = gh * gw
        channels = 3
        patch = int(round((pixels.shape[1] / (channels * tp)) ** 0.5))
        # (frames, n, C, T, p, p): the image processor repeated each frame T times.
        framed = pixels.view(len(frames), n, channels, tp, patch, patch)[:, :, :, 0]
        groups = framed.view(len(frames) // tp, tp, n, channels, patch, patch)
        # -> (groups, n, C, T, p, p) flattened like the image layout.
        video = groups.permute(0, 2, 3, 1, 4, 5).reshape(len(frames) // tp * n, -1)
        grid = torch.tensor([[len(frames) // tp, gh, gw]], dtype=torch.long)
        return video.contiguous(), grid

    def media_order(self, ids: Sequence[int]) -> list[str]:
        """One item per run of a placeholder token."""
        by_id = {v: k for k, v in self.token_ids.items()}
        kinds: list[str] = []
        prev = None
        for t in ids:
            if t in by_id and t != prev:
                kinds.append(by_id[t])
            prev = t
        return kinds

    def positions(
        self, ids: Sequence[int] | torch.Tensor, inputs: MultiModalInputs | None
    ) -> tuple[torch.Tensor, int] | None:
        """Qwen2-VL's M-RoPE (:func:`~polyrl.core.multimodal.mrope_positions`)."""
        return mrope_positions(ids, inputs, self.token_ids, self.merge_size)

    def split_items(self, inputs: MultiModalInputs) -> list[tuple[dict[str, torch.Tensor], str]]:
        """Give each item its ``t*h*w`` pixel rows and its grid."""
        rows_taken = {"image": 0, "video": 0}
        grid_taken = {"image": 0, "video": 0}
        out = []
        for kind in inputs.kinds:
            pix_name, grid_name = self.TENSORS[kind]
            pixels, grids = inputs.tensors.get(pix_name), inputs.tensors.get(grid_name)
            if pixels is None or grids is None or grid_taken[kind] >= len(grids):
                raise MultiModalInputError(
                    f"multi_modal has a {kind} but no {pix_name}/{grid_name} for it"
                )
            grid = grids[grid_taken[kind] : grid_taken[kind] + 1]
            rows = int(grid.prod())
            lo = rows_taken[kind]
            if lo + rows > pixels.shape[0]:
                raise MultiModalInputError(
                    f"multi_modal {pix_name} has {pixels.shape[0]} rows, fewer than its grids need"
                )
            shape = "x".join(str(v) for v in grid[0].tolist())
            out.append(({pix_name: pixels[lo : lo + rows], grid_name: grid}, shape))
            rows_taken[kind] += rows
            grid_taken[kind] += 1
        return out

    def encode_item(self, model: nn.Module, kind: str, tensors: dict[str, torch.Tensor]):
        """``get_image_features`` / ``get_video_features`` of the inner model."""
        pix_name, grid_name = self.TENSORS[kind]
        inner = model.model
        method = inner.get_image_features if kind == "image" else inner.get_video_features
        out = method(tensors[pix_name], tensors[grid_name], return_dict=True)
        emb = out.pooler_output
        return emb if isinstance(emb, torch.Tensor) else torch.cat(list(emb), dim=0)

    def dummy_features(self, model: nn.Module, device: torch.device) -> torch.Tensor:
        """Run the tower (merger included) on one merge group of zero patches."""
        tower = self.tower_modules(model)[0]
        m = self.merge_size
        dtype = next(tower.parameters()).dtype
        pixels = torch.zeros(m * m, self.patch_dim, dtype=dtype, device=device)
        grid = torch.tensor([[1, m, m]], dtype=torch.long, device=device)
        return _vision_output(tower(pixels, grid_thw=grid))

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        """Return the patch merger (the vision blocks are no-split modules already)."""
        merger = _submodule(model, "model.visual.merger")
        return [merger] if merger is not None else []


class Qwen25VLFamily(Qwen2VLFamily):
    """Qwen2.5-VL: Qwen2-VL's processing and M-RoPE for images (a windowed-attention tower).

    Videos are refused: Qwen2.5-VL scales a video's temporal positions by its frame timing
    (``tokens_per_second``), which :func:`~polyrl.core.multimodal.mrope_positions` does not.
    """

    model_types = ("qwen2_5_vl",)

    def process_videos(
        self, image_processor: Any, clips: Sequence[Sequence[Any]], resize: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Refuse videos (see the class docstring)."""
        raise MultiModalInputError(
            "qwen2_5_vl videos are not supported by polyrl yet (their temporal positions "
            "follow the frame timing); send the frames as images"
        )


def _deepstack_output(out: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Return a Qwen3-VL vision tower's merged output and its DeepStack features.

    transformers 5 returns a model output with ``pooler_output`` (merged) and
    ``deepstack_features``; earlier releases a ``(merged, features)`` tuple.
    """
    if isinstance(out, tuple):
        return out[0], list(out[1])
    return out.pooler_output, list(out.deepstack_features)


class Qwen3VLFamily(Qwen25VLFamily):
    """Qwen3-VL: Qwen2-VL's processing and image M-RoPE, plus DeepStack.

    Differences from Qwen2.5-VL that polyrl handles: 16-pixel patches (the processor's
    ``patch_size``, read from the config like every Qwen-VL); interleaved M-RoPE frequencies
    (inside the model's rotary embedding: the positions themselves are Qwen2-VL's for
    images); and DeepStack: the tower also returns, for each of
    ``vision_config.deepstack_visual_indexes``, that block's features merged to the language
    model's width, which the language model adds to its hidden states at the image tokens
    after decoder layer ``0, 1, ...``.

    :meth:`encode_item` therefore returns ``(tokens, 1 + layers, hidden)`` rows: the input
    embedding, then one DeepStack feature per layer; :meth:`forward_embeds` takes the
    per-layer features of a packed step. Videos are refused: Qwen3-VL's processor writes a
    timestamp before every frame pair, which polyrl's prompt expansion does not.
    """

    model_types = ("qwen3_vl",)

    def __init__(self, config: Any):
        super().__init__(config)
        #: Decoder layers after which DeepStack features are added.
        self.deepstack_layers = len(_get(self.vision_config, "deepstack_visual_indexes", ()) or ())

    def process_videos(
        self, image_processor: Any, clips: Sequence[Sequence[Any]], resize: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Refuse videos (see the class docstring)."""
        raise MultiModalInputError(
            "qwen3_vl videos are not supported by polyrl yet (their prompt carries a "
            "timestamp per frame); send the frames as images"
        )

    def encode_item(self, model: nn.Module, kind: str, tensors: dict[str, torch.Tensor]):
        """Run the tower on one image; return its embedding and DeepStack rows stacked.

        The tower is called directly: ``get_image_features``' return type differs between
        transformers releases.
        """
        pix_name, grid_name = self.TENSORS[kind]
        tower = self.tower_modules(model)[0]
        pixels = tensors[pix_name].to(next(tower.parameters()).dtype)
        merged, deepstack = _deepstack_output(tower(pixels, grid_thw=tensors[grid_name]))
        return torch.stack([merged, *deepstack], dim=1)

    def forward_embeds(
        self,
        model: nn.Module,
        embeds: torch.Tensor,
        position_ids: torch.Tensor,
        logits_index: torch.Tensor,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Run the language model with the step's DeepStack features, then the LM head.

        The language model is called directly: the top-level forward computes the DeepStack
        inputs from pixels itself and takes none from the caller.
        """
        if deepstack is None:
            return super().forward_embeds(model, embeds, position_ids, logits_index, **kwargs)
        mask, features = deepstack
        out = model.model.language_model(
            inputs_embeds=embeds,
            position_ids=position_ids,
            use_cache=False,
            visual_pos_masks=mask,
            deepstack_visual_embeds=list(features),
            **kwargs,
        )
        return model.lm_head(out.last_hidden_state[0, logits_index])

    def dummy_features(self, model: nn.Module, device: torch.device) -> torch.Tensor:
        """Run the tower on one merge group of zero patches: output and DeepStack rows."""
        tower = self.tower_modules(model)[0]
        m = self.merge_size
        dtype = next(tower.parameters()).dtype
        pixels = torch.zeros(m * m, self.patch_dim, dtype=dtype, device=device)
        grid = torch.tensor([[1, m, m]], dtype=torch.long, device=device)
        merged, deepstack = _deepstack_output(tower(pixels, grid_thw=grid))
        # The DeepStack mergers too: every vision unit takes part in backward.
        return torch.cat([merged, *deepstack])

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        """Return the patch merger and the DeepStack mergers."""
        mergers = _submodule(model, "model.visual.deepstack_merger_list")
        return [*super().shard_units(model), *(list(mergers) if mergers is not None else [])]


class SmolVLMFamily(VisionFamily):
    """SmolVLM (Idefics3 layout): SigLIP tiles, pixel-shuffle connector, 1-D positions.

    An image is resized so its longest edge is the processor's ``size["longest_edge"]``, then
    (with ``do_image_splitting``) cut into ``rows x cols`` tiles of the vision encoder's
    ``max_image_size`` plus a global view resized to one tile; each tile fills
    ``image_seq_len = (image_size / patch_size)**2 / scale_factor**2`` image tokens. One
    ``<image>`` placeholder expands to the tiles' runs, each after ``<fake_token_around_image>``
    and a ``<row_r_col_c>`` marker (the global view's marker is ``<global-img>``), rows ended
    by newlines, the whole closed by ``<fake_token_around_image>``: the layout of
    transformers' ``SmolVLMProcessor``. Tensors: ``pixel_values`` ``(tiles, 3, S, S)`` of all
    items, and ``image_rows_cols`` ``(items, 2)``.
    """

    model_types = ("smolvlm",)
    mrope = False
    tower_paths = ("model.vision_model", "model.connector")
    FAKE_TOKEN = "<fake_token_around_image>"
    GLOBAL_TOKEN = "<global-img>"
    IMAGE_TOKEN = "<image>"

    def __init__(self, config: Any):
        super().__init__(config)
        vision = self.vision_config
        self.tile_size = int(_get(vision, "image_size", 512))
        self.patch_size = int(_get(vision, "patch_size", 16))
        self.channels = int(_get(vision, "num_channels", 3))
        self.scale_factor = int(_get(config, "scale_factor", 2))
        self.image_seq_len = (self.tile_size // self.patch_size) ** 2 // self.scale_factor**2
        self._expansions: dict[tuple[int, int], tuple[int, ...]] = {}
        # The marker tokens' ids (bind_tokenizer): the config names only the image token.
        self._fake_id: int | None = None
        self._global_id: int | None = None

    def resize_kwargs(
        self, image_processor: Any, min_pixels: int | None, max_pixels: int | None
    ) -> dict[str, Any]:
        """``image_max_pixels`` bounds the longest edge (``isqrt``); a minimum is refused.

        SmolVLM's processor scales every image (up or down) to one longest edge, so a lower
        bound on the area has no meaning for it.
        """
        if min_pixels:
            raise ValueError(
                "data.image_min_pixels does not apply to smolvlm models: their processor "
                "resizes every image to one longest edge; set data.image_max_pixels (area "
                "bound) only, or 0"
            )
        tile = int((getattr(image_processor, "max_image_size", None) or {}).get("longest_edge", 0))
        tile = tile or self.tile_size
        if not max_pixels:
            return {}
        edge = math.isqrt(int(max_pixels))
        if edge < tile:
            raise ValueError(
                f"data.image_max_pixels={max_pixels} is below one {tile} x {tile} tile, the "
                "smallest image a smolvlm model sees; raise it to at least "
                f"{tile * tile}"
            )
        return {"size": {"longest_edge": edge}}

    def process_images(
        self, image_processor: Any, tokenizer: Any, images: Sequence[Any], resize: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], list[int], list[tuple[int, ...]] | None]:
        """Tiles of every image, each image's tile layout and its expansion."""
        tensors_per_image = []
        layouts = []
        for img in images:
            # One image per call: the processor pads tile counts across a batch's images.
            out = image_processor(
                images=[[img]], return_tensors="pt", return_row_col_info=True, **resize
            )
            tiles = out["pixel_values"][0].float()
            mask = out.get("pixel_attention_mask")
            if mask is not None and not bool(mask.bool().all()):
                raise MultiModalInputError(
                    "the image processor padded a tile; polyrl expects SmolVLM tiles of one "
                    "size (do_image_splitting resizes to whole tiles)"
                )
            rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
            tensors_per_image.append(tiles)
            layouts.append((rows, cols))
        expansions = [self.expansion_ids(tokenizer, r, c) for r, c in layouts]
        counts = [self._tiles(r, c) * self.image_seq_len for r, c in layouts]
        tensors = {
            "pixel_values": torch.cat(tensors_per_image),
            "image_rows_cols": torch.tensor(layouts, dtype=torch.long),
        }
        return tensors, counts, expansions

    @staticmethod
    def _tiles(rows: int, cols: int) -> int:
        return rows * cols + 1 if rows or cols else 1

    def expansion_text(self, rows: int, cols: int) -> str:
        """Return the text one ``<image>`` becomes for an image of ``rows x cols`` tiles."""
        run = self.IMAGE_TOKEN * self.image_seq_len
        parts = []
        for r in range(rows):
            for c in range(cols):
                parts.append(f"{self.FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{run}")
            parts.append("\n")
        if rows or cols:
            parts.append("\n")
        parts.append(f"{self.FAKE_TOKEN}{self.GLOBAL_TOKEN}{run}{self.FAKE_TOKEN}")
        return "".join(parts)

    def expansion_ids(self, tokenizer: Any, rows: int, cols: int) -> tuple[int, ...]:
        """Return :meth:`expansion_text` as token ids.

        Tokenized alone: it starts and ends with a special token, so tokenizing it inside its
        prompt gives the same ids.
        """
        key = (rows, cols)
        if key not in self._expansions:
            text = self.expansion_text(rows, cols)
            self._expansions[key] = tuple(tokenizer.encode(text, add_special_tokens=False))
        return self._expansions[key]

    def media_order(self, ids: Sequence[int]) -> list[str]:
        """One item per bare ``<image>`` and per expanded image (its one ``<global-img>``).

        In an expansion every tile run follows ``<fake_token_around_image>`` and a marker; an
        ``<image>`` anywhere else is a placeholder of its own.
        """
        image = self.token_ids["image"]
        fake = self._fake_id
        ids = list(ids)
        count = 0
        i = 0
        while i < len(ids):
            if ids[i] != image:
                i += 1
                continue
            if i >= 2 and ids[i - 2] == fake:
                # A tile run of an expansion; the global view's run counts the item.
                if self._global_id is not None and ids[i - 1] == self._global_id:
                    count += 1
                i += self.image_seq_len
                continue
            count += 1
            i += 1
        return ["image"] * count

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """Learn the marker tokens' ids (the config names only the image token)."""
        self._fake_id = _token_id(tokenizer, self.FAKE_TOKEN)
        self._global_id = _token_id(tokenizer, self.GLOBAL_TOKEN)

    def split_items(self, inputs: MultiModalInputs) -> list[tuple[dict[str, torch.Tensor], str]]:
        """Give each item its tiles (``rows * cols + 1``, or 1 unsplit) and its layout."""
        pixels = inputs.tensors.get("pixel_values")
        layouts = inputs.tensors.get("image_rows_cols")
        if pixels is None or layouts is None or len(layouts) != len(inputs.kinds):
            raise MultiModalInputError(
                "multi_modal needs pixel_values and one image_rows_cols row per image"
            )
        out = []
        lo = 0
        for k, (rows, cols) in enumerate(layouts.tolist()):
            n = self._tiles(rows, cols)
            if lo + n > pixels.shape[0]:
                raise MultiModalInputError(
                    f"multi_modal pixel_values has {pixels.shape[0]} tiles, fewer than image "
                    f"{k}'s layout needs"
                )
            out.append(({"pixel_values": pixels[lo : lo + n]}, f"{rows}x{cols}"))
            lo += n
        return out

    def encode_item(self, model: nn.Module, kind: str, tensors: dict[str, torch.Tensor]):
        """Run the tower and connector on the item's tiles, in tile order.

        The modules are called directly (what ``get_image_features`` does for unpadded
        tiles), since that method's return type differs between transformers releases.
        """
        vision, connector = self.tower_modules(model)
        hidden = vision(pixel_values=tensors["pixel_values"]).last_hidden_state
        features = connector(hidden)
        return features.reshape(-1, features.shape[-1])

    def forward_media(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``pixel_values`` as ``(items, max tiles, 3, S, S)``, zero tiles padding.

        The model drops all-zero tiles (a real tile is never all zero after normalisation)
        and returns one feature entry per row, that is per item.
        """
        pixels = tensors["pixel_values"]
        layouts = tensors["image_rows_cols"].tolist()
        counts = [self._tiles(r, c) for r, c in layouts]
        batch = pixels.new_zeros(len(counts), max(counts), *pixels.shape[1:])
        lo = 0
        for k, n in enumerate(counts):
            batch[k, :n] = pixels[lo : lo + n]
            lo += n
        return {"pixel_values": batch}

    def dummy_features(self, model: nn.Module, device: torch.device) -> torch.Tensor:
        """Run the encoder and connector on one zero tile."""
        vision, connector = self.tower_modules(model)
        dtype = next(vision.parameters()).dtype
        tile = torch.zeros(1, self.channels, self.tile_size, self.tile_size, dtype=dtype)
        hidden = vision(pixel_values=tile.to(device)).last_hidden_state
        return connector(hidden)

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        """Each encoder layer, and the connector (only the attention is a no-split module)."""
        layers = _submodule(model, "model.vision_model.encoder.layers")
        units = list(layers) if layers is not None else []
        connector = _submodule(model, "model.connector")
        return [*units, *([connector] if connector is not None else [])]


def _token_id(tokenizer: Any, token: str) -> int | None:
    ids = tokenizer.encode(token, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


#: Model types polyrl runs, by family class.
VISION_FAMILIES: dict[str, type[VisionFamily]] = {
    t: cls
    for cls in (Qwen2VLFamily, Qwen25VLFamily, Qwen3VLFamily, SmolVLMFamily)
    for t in cls.model_types
}


def vision_family(config: Any, tokenizer: Any = None) -> VisionFamily | None:
    """Return the :class:`VisionFamily` of a model config; ``None`` for a text model.

    Args:
        config: a ``PretrainedConfig`` or a ``config.json`` dict.
        tokenizer: the model's tokenizer (SmolVLM's expansion markers come from it).

    Raises:
        ValueError: a vision model (its config has a ``vision_config``) of another family.
    """
    if _get(config, "vision_config") is None:
        return None
    model_type = _get(config, "model_type")
    cls = VISION_FAMILIES.get(str(model_type))
    if cls is None:
        raise ValueError(
            f"vision model type {model_type!r} is not supported; polyrl runs "
            f"{', '.join(VISION_FAMILIES)}"
        )
    family = cls(config)
    if tokenizer is not None and isinstance(family, SmolVLMFamily):
        family.bind_tokenizer(tokenizer)
    return family
