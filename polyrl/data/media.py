"""Images and videos in data rows: where a row keeps them and how its prompt points at them.

Two row layouts are read, as their trainers write them:

* verl: an ``images`` column (``data.image_key``) holding a list of images -- ``{"bytes": ...,
  "path": ...}`` dicts, raw bytes, PIL images or base64 text -- and a ``videos`` column
  (``data.video_key``) holding frame lists; the prompt's message strings mark where each item
  goes with ``<image>`` / ``<video>``, in order. :func:`media_messages` splits such strings into
  content parts, as verl's dataset does.
* TRL: an ``image`` column (one image) or an ``images`` column, and chat messages whose
  content is already a list of parts (``[{"type": "image"}, {"type": "text", "text": ...}]``);
  a prompt without any placeholder gets its images put in front of the first user message's
  text, as TRL does.

Decoding and processing is the model's :class:`~polyrl.models.processor.VisionProcessor`'s job;
this module only finds the items and lays out the messages.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "IMAGE_PLACEHOLDER",
    "VIDEO_PLACEHOLDER",
    "count_media_parts",
    "expand_mask",
    "has_media",
    "media_messages",
    "resolve_media_paths",
    "row_media",
]

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
_SPLIT = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    if hasattr(value, "tolist") and not hasattr(value, "save"):  # a numpy object array
        return list(value.tolist())
    return [value]  # one image (TRL's ``image`` column)


def row_media(
    row: Mapping[str, Any], image_key: str = "images", video_key: str = "videos"
) -> tuple[list[Any], list[Any]]:
    """Return a row's images and videos (each video a frame list), in column order.

    ``row[image_key]`` may be a list or one image; when the row lacks ``image_key`` its
    ``image`` column is read instead (TRL's one-image layout).
    """
    if image_key in row:
        images = _as_list(row[image_key])
    else:
        images = _as_list(row.get("image"))
    videos = _as_list(row.get(video_key))
    return images, videos


def has_media(row: Mapping[str, Any], image_key: str = "images", video_key: str = "videos") -> bool:
    """Whether the row carries at least one image or video."""
    images, videos = row_media(row, image_key, video_key)
    return bool(images or videos)


def _split_text(text: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for piece in _SPLIT.split(text):
        if piece == IMAGE_PLACEHOLDER:
            parts.append({"type": "image"})
        elif piece == VIDEO_PLACEHOLDER:
            parts.append({"type": "video"})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def count_media_parts(messages: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """Count the image and video parts (or placeholders in strings) of chat messages."""
    images = videos = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            images += content.count(IMAGE_PLACEHOLDER)
            videos += content.count(VIDEO_PLACEHOLDER)
        elif isinstance(content, Sequence):
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else None
                images += kind == "image"
                videos += kind == "video"
    return images, videos


def media_messages(
    messages: Sequence[Mapping[str, Any]], num_images: int, num_videos: int
) -> list[dict[str, Any]]:
    """Return the messages with their media as content parts, ready for a VLM's template.

    A string content holding ``<image>`` / ``<video>`` becomes parts split there (verl); list
    contents are kept. When no message marks any item but the row has some, the items are put
    in front of the first user message (TRL): all images, then all videos. The counts are not
    checked here; the processor names a mismatch.
    """
    marked_images, marked_videos = count_media_parts(messages)
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        content = message.get("content")
        if isinstance(content, str) and _SPLIT.search(content):
            message["content"] = _split_text(content)
        elif isinstance(content, list | tuple):
            message["content"] = [dict(p) for p in content]
        out.append(message)
    if marked_images or marked_videos or not (num_images or num_videos):
        return out
    for message in out:
        if message.get("role") == "user":
            content = message.get("content")
            parts = (
                [{"type": "text", "text": content}]
                if isinstance(content, str)
                else list(content or [])
            )
            media = [{"type": "image"}] * num_images + [{"type": "video"}] * num_videos
            message["content"] = [dict(p) for p in media] + parts
            break
    return out


def resolve_media_paths(items: Sequence[Any], base_dir: str | Path) -> list[Any]:
    """Make the relative ``{"path": ...}`` of images (or video frames) absolute from ``base_dir``.

    verl's parquet files may name images by path relative to the data; a dict with bytes keeps
    its bytes (they win over the path in decoding).
    """
    base = Path(base_dir)

    def fix(item: Any) -> Any:
        if isinstance(item, Mapping):
            path = item.get("path")
            if item.get("bytes") is None and isinstance(path, str) and path:
                expanded = Path(path).expanduser()
                if not expanded.is_absolute():
                    return {**item, "path": str(base / expanded)}
        elif isinstance(item, list | tuple):
            return [fix(x) for x in item]
        return item

    return [fix(x) for x in items]


def expand_mask(
    ids: Sequence[int], mask: Sequence[int], token_ids: Mapping[str, int], counts: Sequence[int]
) -> list[int]:
    """Expand a per-token mask like :func:`~polyrl.core.multimodal.expand_placeholders` expands ids.

    ``ids`` holds one placeholder token per item; item ``k``'s token becomes ``counts[k]``
    copies of its mask value.
    """
    placeholders = set(token_ids.values())
    out: list[int] = []
    k = 0
    for token, m in zip(ids, mask, strict=True):
        if token in placeholders:
            out.extend([m] * counts[k])
            k += 1
        else:
            out.append(m)
    return out
