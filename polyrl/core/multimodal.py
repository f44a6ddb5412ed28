"""Images and videos as model inputs: decoding with limits, processed inputs, M-RoPE positions.

Every service that meets an image imports this module (services import only the core): the
data loader decodes a row's images, the rollout server decodes a request's, the engine and the
rollout engine place the processed inputs at the image tokens with the positions computed here.

Three things are fixed here so the services agree on them:

* :func:`decode_image` is the one door an image comes in by. It accepts PIL images, raw bytes,
  ``{"bytes": ...}`` / ``{"path": ...}`` dicts (verl's and HF datasets' layout), base64 strings
  and ``data:`` URLs; it refuses remote URLs always and paths outside ``allowed_dir``, and it
  reads the header before the pixels, so a 20000 x 20000 image is refused without decoding it.
* :class:`MultiModalInputs` is what travels with a prompt: the processor's tensors plus one
  content digest per image or video (the rollout engine's vision cache and prefix cache key on
  these, so the ``n`` samples of a prompt encode each image once).
* :func:`mrope_positions` computes Qwen2-VL's multi-modal rotary positions for one sequence;
  the trainer's engine and the rollout engine both call it, so their positions agree.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MEDIA_KINDS",
    "MediaLimits",
    "MultiModalInputError",
    "MultiModalInputs",
    "decode_image",
    "decode_video",
    "encode_png",
    "expand_placeholders",
    "image_digest",
    "locate_media",
    "mrope_positions",
]

#: The kinds of media item a prompt may carry, in the order their tensors are keyed.
MEDIA_KINDS: tuple[str, ...] = ("image", "video")


class MultiModalInputError(ValueError):
    """An image or video that cannot be used; the message names what and why."""


@dataclasses.dataclass(frozen=True)
class MediaLimits:
    """Bounds that keep hostile media from exhausting memory.

    Attributes:
        max_image_pixels: width x height of a decoded image (checked from the header).
        max_image_bytes: size of an encoded image.
        max_items: images plus videos in one prompt.
        max_video_frames: frames of one video.
    """

    max_image_pixels: int = 4096 * 4096
    max_image_bytes: int = 32 << 20
    max_items: int = 64
    max_video_frames: int = 256


DEFAULT_LIMITS = MediaLimits()


def _pil() -> Any:
    from PIL import Image

    return Image


def _open_bytes(data: bytes, what: str, limits: MediaLimits) -> Any:
    if len(data) > limits.max_image_bytes:
        raise MultiModalInputError(
            f"{what}: {len(data)} bytes, more than the limit of {limits.max_image_bytes}"
        )
    image_mod = _pil()
    try:
        img = image_mod.open(io.BytesIO(data))
    except image_mod.DecompressionBombError as err:
        # Pillow's own guard fires on the header for the largest images.
        raise MultiModalInputError(
            f"{what}: more than the limit of {limits.max_image_pixels} pixels ({err})"
        ) from None
    except Exception as err:  # PIL raises many types for bad bytes
        raise MultiModalInputError(
            f"{what}: not a readable image ({type(err).__name__}: {err}); expected PNG, JPEG "
            "or another format Pillow reads"
        ) from None
    _check_size(img.size, what, limits)
    try:
        img.load()
    except Exception as err:
        raise MultiModalInputError(
            f"{what}: corrupt image data ({type(err).__name__}: {err})"
        ) from None
    return img


def _check_size(size: tuple[int, int], what: str, limits: MediaLimits) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise MultiModalInputError(f"{what}: empty image ({width} x {height})")
    if width * height > limits.max_image_pixels:
        raise MultiModalInputError(
            f"{what}: {width} x {height} pixels: more than the limit of "
            f"{limits.max_image_pixels} pixels"
        )


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def _read_path(path_text: str, what: str, allowed_dir: str | os.PathLike[str] | None) -> bytes:
    if allowed_dir is None:
        raise MultiModalInputError(
            f"{what}: image paths are not accepted here; send the image bytes (base64) or "
            "start the server with an allowed media directory"
        )
    root = Path(allowed_dir).resolve()
    path = Path(path_text)
    if not path.is_absolute():
        path = root / path
    path = path.resolve()
    if not _inside(path, root):
        raise MultiModalInputError(
            f"{what}: path {path_text!r} is outside the allowed media directory {str(root)!r}"
        )
    try:
        return path.read_bytes()
    except OSError as err:
        raise MultiModalInputError(f"{what}: cannot read {path_text!r} ({err.strerror})") from None


def _decode_text(text: str, what: str, allowed_dir: Any, limits: MediaLimits) -> bytes:
    lowered = text[:16].lower()
    if lowered.startswith(("http://", "https://", "ftp://", "file://")):
        raise MultiModalInputError(
            f"{what}: remote URLs are not fetched; send the image as a data: URL or base64"
        )
    if lowered.startswith("data:"):
        header, sep, payload = text.partition(",")
        if not sep or ";base64" not in header:
            raise MultiModalInputError(
                f"{what}: a data: URL must look like data:image/png;base64,<payload>"
            )
        text = payload
    elif "." in text[-8:] or text.startswith(("/", "~")):
        # "." is not a base64 character: a string ending in an extension is a path.
        return _read_path(text, what, allowed_dir)
    if len(text) > limits.max_image_bytes * 4 // 3 + 8:
        raise MultiModalInputError(
            f"{what}: base64 payload longer than the limit of {limits.max_image_bytes} bytes"
        )
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MultiModalInputError(
            f"{what}: not valid base64 (expected base64 image bytes or a data: URL)"
        ) from None


def decode_image(
    item: Any,
    *,
    what: str = "image",
    allowed_dir: str | os.PathLike[str] | None = None,
    limits: MediaLimits = DEFAULT_LIMITS,
) -> Any:
    """Turn one image in any accepted form into an RGB PIL image.

    Args:
        item: a PIL image; ``bytes``; ``{"bytes": ...}`` or ``{"path": ...}`` (verl, HF
            ``datasets``); ``{"image": ...}`` or ``{"image_url": ...}``; a base64 string, a
            ``data:`` URL, or (only with ``allowed_dir``) a path.
        what: how errors name the item (e.g. ``"row 12: images[0]"``).
        allowed_dir: the directory paths must lie in; ``None`` refuses paths.
        limits: size bounds.

    Raises:
        MultiModalInputError: anything unusable, naming ``what``.
    """
    image_mod = _pil()
    if isinstance(item, image_mod.Image):
        _check_size(item.size, what, limits)
        img = item
    elif isinstance(item, bytes | bytearray | memoryview):
        img = _open_bytes(bytes(item), what, limits)
    elif isinstance(item, Mapping):
        if item.get("bytes") is not None:
            return decode_image(item["bytes"], what=what, allowed_dir=allowed_dir, limits=limits)
        if item.get("path"):
            data = _read_path(str(item["path"]), what, allowed_dir)
            img = _open_bytes(data, what, limits)
        elif item.get("image") is not None:
            return decode_image(item["image"], what=what, allowed_dir=allowed_dir, limits=limits)
        elif item.get("image_url") is not None:
            url = item["image_url"]
            url = url.get("url") if isinstance(url, Mapping) else url
            return decode_image(url, what=what, allowed_dir=None, limits=limits)
        elif item.get("url") is not None:
            return decode_image(item["url"], what=what, allowed_dir=None, limits=limits)
        else:
            raise MultiModalInputError(
                f"{what}: a dict image needs 'bytes' or 'path' (got keys {sorted(item)})"
            )
    elif isinstance(item, str):
        img = _open_bytes(_decode_text(item, what, allowed_dir, limits), what, limits)
    else:
        raise MultiModalInputError(
            f"{what}: a {type(item).__name__} is not an image; expected a PIL image, bytes, "
            "{'bytes': ...}, {'path': ...}, base64 or a data: URL"
        )
    return img if img.mode == "RGB" else img.convert("RGB")


def decode_video(
    item: Any,
    *,
    what: str = "video",
    allowed_dir: str | os.PathLike[str] | None = None,
    limits: MediaLimits = DEFAULT_LIMITS,
) -> list[Any]:
    """Turn a video given as a list of frames (any form :func:`decode_image` takes) into frames.

    Raises:
        MultiModalInputError: not a list, empty, too many frames, or a bad frame.
    """
    if isinstance(item, Mapping) and "frames" in item:
        item = item["frames"]
    if isinstance(item, str | bytes) or not isinstance(item, Sequence):
        raise MultiModalInputError(
            f"{what}: a video must be a list of frames (images), got {type(item).__name__}"
        )
    if not item:
        raise MultiModalInputError(f"{what}: a video needs at least one frame")
    if len(item) > limits.max_video_frames:
        raise MultiModalInputError(
            f"{what}: {len(item)} frames, more than the limit of {limits.max_video_frames}"
        )
    return [
        decode_image(f, what=f"{what} frame {i}", allowed_dir=allowed_dir, limits=limits)
        for i, f in enumerate(item)
    ]


def encode_png(img: Any) -> bytes:
    """Return a decoded image as PNG bytes (lossless, so the receiver sees the same pixels)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def image_digest(img: Any) -> str:
    """Return a content hash of a decoded image (mode, size and pixels), stable across processes."""
    h = hashlib.sha256()
    h.update(f"{img.mode}:{img.size[0]}x{img.size[1]}:".encode())
    h.update(img.tobytes())
    return h.hexdigest()[:32]


@dataclasses.dataclass
class MultiModalInputs:
    """A prompt's processed images and videos, ready for the model.

    Attributes:
        tensors: the processor's outputs by the model's argument names (Qwen2-VL:
            ``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``).
        kinds: ``"image"`` or ``"video"`` per item, in prompt order.
        digests: a content hash per item (see :func:`image_digest`), in prompt order.
        token_counts: how many placeholder tokens each item fills, in prompt order.
        sources: the items themselves, encoded, in prompt order (an image: PNG bytes; a video:
            a list of PNG bytes), so a rollout server (or vLLM) can be sent the media and
            process them itself; empty when the inputs were built from tensors only.
        expansions: per item, the token ids its placeholder becomes, for families whose
            expansion holds other tokens than the placeholder (SmolVLM wraps each image tile's
            run in marker tokens); empty: item ``k``'s placeholder becomes one run of
            ``token_counts[k]`` placeholder tokens (Qwen2-VL).
        pixel_bounds: the ``(min_pixels, max_pixels)`` the items were processed with
            (``None``: the model's own); sent with the sources so that a server processing
            them again makes the same number of tokens per image.
    """

    tensors: dict[str, torch.Tensor]
    kinds: tuple[str, ...]
    digests: tuple[str, ...]
    token_counts: tuple[int, ...]
    sources: tuple[Any, ...] = ()
    expansions: tuple[tuple[int, ...], ...] = ()
    pixel_bounds: tuple[int | None, int | None] = (None, None)

    def __post_init__(self) -> None:
        n = len(self.kinds)
        if len(self.digests) != n or len(self.token_counts) != n:
            raise ValueError("kinds, digests and token_counts must have one entry per item")
        if self.sources and len(self.sources) != n:
            raise ValueError("sources must be empty or have one entry per item")
        if self.expansions and len(self.expansions) != n:
            raise ValueError("expansions must be empty or have one entry per item")

    def expansion(self, index: int, placeholder: int) -> tuple[int, ...]:
        """Return the token ids item ``index``'s placeholder (token ``placeholder``) becomes."""
        if self.expansions:
            return self.expansions[index]
        return (placeholder,) * self.token_counts[index]

    @property
    def expanded_lengths(self) -> tuple[int, ...]:
        """How many prompt tokens each item's expanded placeholder takes, in prompt order."""
        if self.expansions:
            return tuple(len(e) for e in self.expansions)
        return self.token_counts

    def media_payload(self) -> dict[str, Any]:
        """Return the sources as the rollout API's ``images`` / ``videos`` fields (base64).

        Non-default :attr:`pixel_bounds` go along as ``mm_processor_kwargs`` (vLLM's name).

        Raises:
            ValueError: the inputs carry no sources.
        """
        if not self.sources:
            raise ValueError("these multi-modal inputs carry no sources to send")
        out: dict[str, Any] = {"images": [], "videos": []}
        for kind, src in zip(self.kinds, self.sources, strict=True):
            if kind == "image":
                out["images"].append(base64.b64encode(src).decode())
            else:
                out["videos"].append([base64.b64encode(f).decode() for f in src])
        bounds = dict(zip(("min_pixels", "max_pixels"), self.pixel_bounds, strict=True))
        kwargs = {k: int(v) for k, v in bounds.items() if v is not None}
        if kwargs:
            out["mm_processor_kwargs"] = kwargs
        return out

    def __len__(self) -> int:
        return len(self.kinds)

    @property
    def key(self) -> str:
        """One hash of every item, in order: equal keys mean equal media."""
        return hashlib.sha256("|".join(self.digests).encode()).hexdigest()[:32]

    def grids(self, kind: str) -> torch.Tensor | None:
        """Return the ``(items, 3)`` grid of one kind (``None`` when the prompt has none)."""
        return self.tensors.get(f"{kind}_grid_thw")

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> MultiModalInputs:
        """Return a copy on ``device`` (floating tensors cast to ``dtype`` if given)."""
        moved = {
            k: v.to(
                device=device,
                dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype,
            )
            for k, v in self.tensors.items()
        }
        return dataclasses.replace(self, tensors=moved)

    @staticmethod
    def concat(parts: Sequence[MultiModalInputs]) -> MultiModalInputs:
        """Join the inputs of several prompts side by side (the model sees their items in order)."""
        keys: list[str] = []
        for p in parts:
            keys.extend(k for k in p.tensors if k not in keys)
        tensors = {
            k: torch.cat([p.tensors[k] for p in parts if k in p.tensors], dim=0) for k in keys
        }
        return MultiModalInputs(
            tensors=tensors,
            kinds=tuple(k for p in parts for k in p.kinds),
            digests=tuple(d for p in parts for d in p.digests),
            token_counts=tuple(c for p in parts for c in p.token_counts),
            sources=tuple(s for p in parts for s in p.sources)
            if all(p.sources for p in parts)
            else (),
            expansions=tuple(e for p in parts for e in p.expansions)
            if any(p.expansions for p in parts)
            else (),
        )


def expand_placeholders(
    ids: Sequence[int], token_ids: Mapping[str, int], inputs: MultiModalInputs
) -> list[int]:
    """Expand one placeholder per item to the tokens that item fills.

    ``ids`` may already be expanded (then it is returned unchanged after the check): each
    item's place holds either its placeholder token once or exactly its expansion
    (:meth:`MultiModalInputs.expansion`: a run of ``token_counts[k]`` placeholder tokens, or
    the family's marker-wrapped tile runs).

    Args:
        ids: prompt token ids.
        token_ids: placeholder token id by kind (``{"image": ..., "video": ...}``).
        inputs: the prompt's processed media.

    Raises:
        MultiModalInputError: more or fewer placeholders than items, or a run of the wrong
            length.
    """
    return locate_media(ids, token_ids, inputs)[0]


def locate_media(
    ids: Sequence[int], token_ids: Mapping[str, int], inputs: MultiModalInputs
) -> tuple[list[int], list[int]]:
    """Expand ``ids`` like :func:`expand_placeholders`; also return where each item starts.

    Returns:
        ``(expanded ids, start of each item's expansion in them)``, items in prompt order.
    """
    ids = list(ids)
    by_id = {v: k for k, v in token_ids.items()}
    kinds = list(inputs.kinds)
    # Without explicit expansions an item is one run of its placeholder: a run counts once.
    runs = not inputs.expansions
    out: list[int] = []
    starts: list[int] = []
    k = 0
    i = 0
    n = len(ids)
    while i < n:
        token = ids[i]
        if k < len(kinds):
            exp = inputs.expansion(k, token_ids[kinds[k]])
            end = i + len(exp)
            # A run longer than the expansion is no match (its length is the error).
            longer = runs and end < n and ids[end] == token
            if exp and token == exp[0] and tuple(ids[i:end]) == exp and not longer:
                starts.append(len(out))
                out.extend(exp)
                i = end
                k += 1
                continue
        kind = by_id.get(token)
        if kind is None:
            out.append(token)
            i += 1
            continue
        length = 1
        if runs:
            while i + length < n and ids[i + length] == token:
                length += 1
        if k >= len(kinds) or kinds[k] != kind:
            found = _placeholder_kinds(ids, by_id, runs)
            raise MultiModalInputError(
                f"the prompt has {len(found)} media placeholder(s) ({_count(found)}) but "
                f"{len(kinds)} item(s) were given ({_count(kinds)}); "
                "put one placeholder per image or video, in order"
            )
        if length != 1:
            raise MultiModalInputError(
                f"a {kind} placeholder run has {length} tokens; the {kind} fills "
                f"{inputs.token_counts[k]} (send one placeholder token, or exactly that many)"
            )
        starts.append(len(out))
        out.extend(inputs.expansion(k, token))
        i += 1
        k += 1
    if k != len(kinds):
        found = _placeholder_kinds(ids, by_id, runs)
        raise MultiModalInputError(
            f"the prompt has {len(found)} media placeholder(s) ({_count(found)}) but "
            f"{len(kinds)} item(s) were given ({_count(kinds)}); "
            "put one placeholder per image or video, in order"
        )
    return out, starts


def _placeholder_kinds(ids: list[int], by_id: Mapping[int, str], runs: bool) -> list[str]:
    """Return the kinds of the placeholders in ``ids`` (for error messages)."""
    found: list[str] = []
    prev = None
    for t in ids:
        if t in by_id and not (runs and t == prev):
            found.append(by_id[t])
        prev = t
    return found


def _count(kinds: list[str]) -> str:
    return ", ".join(f"{kinds.count(k)} {k}" for k in MEDIA_KINDS) or "none"


def mrope_positions(
    ids: Sequence[int] | torch.Tensor,
    inputs: MultiModalInputs | None,
    token_ids: Mapping[str, int],
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """Qwen2-VL's multi-modal rotary positions of one sequence, and its position delta.

    Text tokens count up by one. An item's run of tokens takes ``(t, h, w)`` positions over its
    merged grid, all offset by the position where the run starts; the next text token starts
    ``max(h, w)`` (merged) after that offset. Tokens generated after the sequence continue at
    ``len + delta`` on all three axes.

    Args:
        ids: the sequence's token ids (expanded placeholders).
        inputs: its media (``None``: plain text, positions ``0..len-1``).
        token_ids: placeholder token id by kind.
        spatial_merge_size: the vision tower's patch merge factor.

    Returns:
        ``((3, len) long tensor, delta)`` with ``delta = max position + 1 - len``.
    """
    ids_list = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    n = len(ids_list)
    if inputs is None or not len(inputs):
        return torch.arange(n).view(1, -1).expand(3, -1).clone(), 0
    grids = {k: iter(g.tolist()) for k in MEDIA_KINDS if (g := inputs.grids(k)) is not None}
    by_id = {v: k for k, v in token_ids.items()}
    pieces: list[torch.Tensor] = []
    pos = 0
    i = 0
    while i < n:
        kind = by_id.get(ids_list[i])
        if kind is None:
            j = i
            while j < n and ids_list[j] not in by_id:
                j += 1
            pieces.append(torch.arange(pos, pos + j - i).view(1, -1).expand(3, -1))
            pos += j - i
            i = j
            continue
        try:
            t, h, w = next(grids[kind])
        except (KeyError, StopIteration):
            raise MultiModalInputError(
                f"the sequence has more {kind} runs than the inputs have {kind}s"
            ) from None
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        tt = torch.arange(t).view(-1, 1, 1).expand(t, gh, gw)
        hh = torch.arange(gh).view(1, -1, 1).expand(t, gh, gw)
        ww = torch.arange(gw).view(1, 1, -1).expand(t, gh, gw)
        block = torch.stack([tt, hh, ww]).reshape(3, -1) + pos
        length = block.shape[1]
        if ids_list[i : i + length] != [ids_list[i]] * length:
            raise MultiModalInputError(
                f"a {kind} fills {length} tokens but its placeholder run is shorter"
            )
        pieces.append(block)
        pos += max(gh, gw)
        i += length
    positions = torch.cat(pieces, dim=1)
    delta = int(positions.max()) + 1 - n
    return positions, delta
