"""Vision-language models in the model engine: media inputs, M-RoPE positions, the vision tower.

A Qwen2-VL-family model is a causal LM over its tokens whose image/video placeholder tokens are
replaced by the vision tower's output.  Batches carry each row's processed media in the object
column :data:`~polyrl.core.columns.MULTI_MODAL` (a
:class:`~polyrl.core.multimodal.MultiModalInputs`, or ``None`` for a text row) and its
``input_ids`` hold the *expanded* placeholder runs.  For a micro-batch the engine then passes

* the media tensors of its rows concatenated in row order (``None`` rows skipped): the model
  fills placeholder tokens in the order they appear in the flattened compute layout, which is row
  order for the padded, trimmed and packed layouts alike;
* ``position_ids`` of shape ``(4, R, W)``: row 0 the ordinary per-sequence text positions (what
  packed attention finds sequence boundaries from), rows 1-3 the ``(t, h, w)`` M-RoPE positions of
  :func:`~polyrl.core.multimodal.mrope_positions`, computed over each row's real tokens.

Under FSDP each vision block is its own unit, so every rank must run the vision tower the same
number of times per micro-batch.  A rank with fewer media calls than another (a text-only
micro-batch) runs the tower on a one-patch dummy input and adds ``0 *`` its output to the token
embeddings (:func:`dummy_vision_calls`), so forward gathers and backward reductions match.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from polyrl.core.multimodal import MEDIA_KINDS, MultiModalInputs, mrope_positions

__all__ = [
    "MicroBatchMedia",
    "VisionInfo",
    "column_vision_calls",
    "dummy_vision_calls",
    "encode_once",
    "freeze_vision_tower",
    "media_tensors",
    "mrope_position_column",
    "vision_calls",
    "vision_info",
    "vision_tower",
]

#: Parameter-name prefix of the vision tower in Hugging Face's VLM classes (Qwen2-VL family).
VISION_PREFIX = "model.visual."


def vision_tower(model: nn.Module) -> nn.Module | None:
    """Return the vision tower (``model.model.visual``), or ``None`` for a text model."""
    inner = getattr(model, "model", None)
    tower = getattr(inner, "visual", None) if isinstance(inner, nn.Module) else None
    return tower if isinstance(tower, nn.Module) else None


@dataclass(frozen=True)
class VisionInfo:
    """What the engine needs to know of a VLM's config.

    Attributes:
        token_ids: placeholder token id by media kind (``{"image": ..., "video": ...}``).
        merge_size: the vision tower's spatial patch merge factor.
        patch_dim: values per patch row of ``pixel_values`` (channels x temporal x patch^2).
    """

    token_ids: dict[str, int]
    merge_size: int
    patch_dim: int


def vision_info(model: nn.Module) -> VisionInfo | None:
    """Return a VLM's :class:`VisionInfo` (from its config), ``None`` for a text model."""
    if vision_tower(model) is None:
        return None
    config = model.config
    vcfg = config.vision_config
    token_ids = {"image": int(config.image_token_id)}
    if getattr(config, "video_token_id", None) is not None:
        token_ids["video"] = int(config.video_token_id)
    patch = int(vcfg.patch_size)
    temporal = int(getattr(vcfg, "temporal_patch_size", 1) or 1)
    channels = int(getattr(vcfg, "in_channels", getattr(vcfg, "in_chans", 3)))
    return VisionInfo(token_ids, int(vcfg.spatial_merge_size), channels * temporal * patch * patch)


def freeze_vision_tower(model: nn.Module) -> int:
    """Set ``requires_grad=False`` on every vision-tower parameter; return how many.

    Raises:
        ValueError: the model has no vision tower.
    """
    tower = vision_tower(model)
    if tower is None:
        raise ValueError(
            f"ModelSpec.freeze_vision_tower: {type(model).__name__} has no vision tower "
            "(model.visual); it applies to vision-language models only"
        )
    params = list(tower.parameters())
    for param in params:
        param.requires_grad_(False)
    return len(params)


def _row_inputs(column: Any, rows: int) -> list[MultiModalInputs | None]:
    items = list(column) if column is not None else [None] * rows
    for i, item in enumerate(items):
        if item is not None and not isinstance(item, MultiModalInputs):
            raise TypeError(
                f"multi_modal column, row {i}: expected a MultiModalInputs or None, got "
                f"{type(item).__name__}"
            )
    return items


@dataclass(frozen=True)
class MicroBatchMedia:
    """The media of a micro-batch, each distinct inputs object once.

    Attributes:
        tensors: the distinct inputs' tensors joined in order of first appearance, on the
            compute device (what the model's forward gets).
        expand: per media kind, the index (into that kind's encoded items) of every item in
            row order, when rows share inputs (the samples of a prompt); ``None`` when every
            row's media is its own, so the encoded items are already in row order.
    """

    tensors: dict[str, torch.Tensor]
    expand: dict[str, list[int]] | None


def media_tensors(column: Any, rows: int, device: torch.device) -> MicroBatchMedia | None:
    """Return the media of a micro-batch's rows (``None`` when no row has any).

    ``column`` holds each row's inputs (``None`` for text rows).  Rows holding the same inputs
    object are encoded once: the model fills placeholder tokens in row order through
    :attr:`MicroBatchMedia.expand` (see :func:`encode_once`).
    """
    parts = [m for m in _row_inputs(column, rows) if m is not None and len(m)]
    if not parts:
        return None
    unique: list[MultiModalInputs] = []
    slot: dict[int, int] = {}
    for m in parts:
        if id(m) not in slot:
            slot[id(m)] = len(unique)
            unique.append(m)
    joined = unique[0] if len(unique) == 1 else MultiModalInputs.concat(unique)
    tensors = {k: v.to(device) for k, v in joined.tensors.items()}
    if len(unique) == len(parts):
        return MicroBatchMedia(tensors, None)
    # Item numbers of each distinct inputs object, per kind, in the encoded order.
    owned: list[dict[str, list[int]]] = []
    seen = dict.fromkeys(MEDIA_KINDS, 0)
    for m in unique:
        own: dict[str, list[int]] = {kind: [] for kind in MEDIA_KINDS}
        for kind in m.kinds:
            own[kind].append(seen[kind])
            seen[kind] += 1
        owned.append(own)
    expand: dict[str, list[int]] = {kind: [] for kind in MEDIA_KINDS}
    for m in parts:
        for kind, items in owned[slot[id(m)]].items():
            expand[kind].extend(items)
    return MicroBatchMedia(tensors, expand)


_FEATURE_METHODS = {"image": "get_image_features", "video": "get_video_features"}


@contextlib.contextmanager
def encode_once(model: nn.Module, media: MicroBatchMedia | None) -> Iterator[None]:
    """Context in which the model's forward repeats encoded items as ``media.expand`` says.

    Hugging Face's Qwen2-VL encodes ``pixel_values`` with ``get_image_features`` (videos:
    ``get_video_features``) inside its forward, where FSDP has gathered the root's parameters,
    and needs one feature run per placeholder run.  The inner model's methods are wrapped for
    the duration to index the per-item features, so a prompt's images go through the vision
    tower once however many of its samples the micro-batch holds (the copies' gradients add).
    """
    if media is None or media.expand is None:
        yield
        return
    inner = model.model
    wrapped_methods = []
    for kind, method in _FEATURE_METHODS.items():
        original = getattr(inner, method)
        index = media.expand[kind]

        def wrapped(*args: Any, _original: Any = original, _index: list[int] = index, **kw: Any):
            out = _original(*args, **kw)
            items = out.pooler_output
            out.pooler_output = tuple(items[i] for i in _index)
            return out

        setattr(inner, method, wrapped)
        wrapped_methods.append(method)
    try:
        yield
    finally:
        for method in wrapped_methods:
            # The wrappers are instance attributes: removing them uncovers the class methods.
            delattr(inner, method)


def vision_calls(media: dict[str, torch.Tensor] | None) -> int:
    """How many times the model's forward runs its vision tower for ``media`` (images, videos)."""
    if not media:
        return 0
    return int("pixel_values" in media) + int("pixel_values_videos" in media)


def column_vision_calls(column: Any) -> int:
    """:func:`vision_calls` of the media of ``column``'s rows, without joining their tensors."""
    items = [m for m in _row_inputs(column, 0) if m is not None and len(m)]
    keys = {k for m in items for k in m.tensors}
    return int("pixel_values" in keys) + int("pixel_values_videos" in keys)


def mrope_position_column(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    column: Any,
    info: VisionInfo,
) -> torch.Tensor:
    """Per-token ``(b, T, 4)`` positions: text positions, then M-RoPE ``(t, h, w)``.

    M-RoPE positions are computed over each row's real tokens (one contiguous run, as the engine's
    batch contract requires) and are 0 on padding; text rows count up like their text positions.
    """
    b, t = input_ids.shape
    out = torch.zeros(b, t, 4, dtype=torch.long, device=input_ids.device)
    out[..., 0] = position_ids
    mask = attention_mask.bool()
    items = _row_inputs(column, b)
    for row in range(b):
        cols = mask[row].nonzero().view(-1)
        start, end = int(cols[0]), int(cols[-1]) + 1
        ids = input_ids[row, start:end].cpu()
        pos, _ = mrope_positions(ids, items[row], info.token_ids, info.merge_size)
        out[row, start:end, 1:] = pos.t().to(out.device)
    return out


def _vision_output(out: Any) -> torch.Tensor:
    """Return the tensor a vision tower gave (transformers 5 wraps it in a model output)."""
    if isinstance(out, torch.Tensor):
        return out
    for name in ("pooler_output", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"unexpected vision tower output {type(out).__name__}")


@contextlib.contextmanager
def dummy_vision_calls(model: nn.Module, info: VisionInfo | None, calls: int) -> Iterator[None]:
    """Context in which the model's next forward also runs its vision tower ``calls`` times.

    Each run is on a one-patch-group dummy image; ``0 *`` its output sum is added to the token
    embeddings, so the result is unchanged while every vision FSDP unit takes part in forward and
    backward like on a rank that encodes real media.  The runs happen inside the root module's
    forward (in a hook on the input embeddings), where FSDP has gathered the root's parameters.
    """
    tower = vision_tower(model)
    if calls <= 0 or tower is None or info is None:
        yield
        return
    m = info.merge_size

    def hook(module: nn.Module, args: Sequence[Any], output: torch.Tensor) -> torch.Tensor:
        dtype = next(tower.parameters()).dtype
        pixels = torch.zeros(m * m, info.patch_dim, dtype=dtype, device=output.device)
        grid = torch.tensor([[1, m, m]], dtype=torch.long, device=output.device)
        extra = output.new_zeros(())
        for _ in range(calls):
            extra = extra + _vision_output(tower(pixels, grid_thw=grid)).sum().to(output.dtype)
        return output + 0.0 * extra

    # The inner model's embeddings: a value model's wrapper has no get_input_embeddings.
    handle = model.model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
