"""Vision-language models in the model engine: media inputs, M-RoPE positions, the vision tower.

A VLM is a causal LM over its tokens whose image/video placeholder tokens are replaced by the
vision tower's output; what differs between families (Qwen2-VL, SmolVLM) comes from its
:class:`~polyrl.models.vision_family.VisionFamily`.  Batches carry each row's processed media
in the object column :data:`~polyrl.core.columns.MULTI_MODAL` (a
:class:`~polyrl.core.multimodal.MultiModalInputs`, or ``None`` for a text row) and its
``input_ids`` hold the *expanded* placeholder runs.  For a micro-batch the engine then passes

* the media tensors of its rows concatenated in row order (``None`` rows skipped): the model
  fills placeholder tokens in the order they appear in the flattened compute layout, which is row
  order for the padded, trimmed and packed layouts alike;
* M-RoPE families (Qwen2-VL): ``position_ids`` of shape ``(4, R, W)``: row 0 the ordinary
  per-sequence text positions (what packed attention finds sequence boundaries from), rows 1-3
  the ``(t, h, w)`` M-RoPE positions of :func:`~polyrl.core.multimodal.mrope_positions`,
  computed over each row's real tokens; other families (SmolVLM) the text positions.

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

from polyrl.core.multimodal import MEDIA_KINDS, MultiModalInputs
from polyrl.models.vision_family import VisionFamily, vision_family

__all__ = [
    "MicroBatchMedia",
    "column_vision_calls",
    "dummy_vision_calls",
    "encode_once",
    "freeze_vision_tower",
    "media_tensors",
    "mrope_position_column",
    "vision_calls",
    "vision_info",
]


def vision_info(model: nn.Module) -> VisionFamily | None:
    """Return a VLM's :class:`~polyrl.models.vision_family.VisionFamily`; ``None``: text model.

    Raises:
        ValueError: a vision model of a family polyrl does not run.
    """
    config = getattr(model, "config", None)
    family = vision_family(config) if config is not None else None
    if family is None or not family.tower_modules(model):
        return None
    return family


def freeze_vision_tower(model: nn.Module) -> int:
    """Set ``requires_grad=False`` on every vision-tower parameter; return how many.

    The tower is the family's vision encoder and its projection into the language model
    (Qwen2-VL: ``model.visual``; SmolVLM: ``model.vision_model`` and ``model.connector``).

    Raises:
        ValueError: the model has no vision tower.
    """
    family = vision_info(model)
    if family is None:
        raise ValueError(
            f"ModelSpec.freeze_vision_tower: {type(model).__name__} has no vision tower; it "
            "applies to vision-language models only"
        )
    params = [p for m in family.tower_modules(model) for p in m.parameters()]
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
    Qwen3-VL's per-layer DeepStack features are repeated the same way.
    """
    if media is None or media.expand is None:
        yield
        return
    inner = model.model
    wrapped_methods = []
    for kind, method in _FEATURE_METHODS.items():
        original = getattr(inner, method, None)
        if original is None:  # a family without this kind of media (SmolVLM: videos)
            continue
        index = media.expand[kind]

        def wrapped(*args: Any, _original: Any = original, _index: list[int] = index, **kw: Any):
            out = _original(*args, **kw)
            items = out.pooler_output
            out.pooler_output = tuple(items[i] for i in _index)
            # Qwen3-VL's DeepStack features: per layer, one entry per item like the output.
            layers = getattr(out, "deepstack_features", None)
            if layers is not None:
                out.deepstack_features = [tuple(f[i] for i in _index) for f in layers]
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
    family: VisionFamily,
) -> torch.Tensor:
    """Per-token ``(b, T, 4)`` positions of an M-RoPE family: text positions, then ``(t, h, w)``.

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
        found = family.positions(ids, items[row])
        if found is None:
            raise ValueError(f"{family.model_type} models use 1-D positions, not M-RoPE")
        out[row, start:end, 1:] = found[0].t().to(out.device)
    return out


@contextlib.contextmanager
def dummy_vision_calls(model: nn.Module, family: VisionFamily | None, calls: int) -> Iterator[None]:
    """Context in which the model's next forward also runs its vision tower ``calls`` times.

    Each run is on the family's minimal dummy input; ``0 *`` its output sum is added to the token
    embeddings, so the result is unchanged while every vision FSDP unit takes part in forward and
    backward like on a rank that encodes real media.  The runs happen inside the root module's
    forward (in a hook on the input embeddings), where FSDP has gathered the root's parameters.
    """
    if calls <= 0 or family is None or not family.tower_modules(model):
        yield
        return

    def hook(module: nn.Module, args: Sequence[Any], output: torch.Tensor) -> torch.Tensor:
        extra = output.new_zeros(())
        for _ in range(calls):
            extra = extra + family.dummy_features(model, output.device).sum().to(output.dtype)
        return output + 0.0 * extra

    # The inner model's embeddings: a value model's wrapper has no get_input_embeddings.
    handle = model.model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
