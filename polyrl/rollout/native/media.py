"""Images and videos in the native engine: per-sequence media state and the embedding cache.

A vision-language request carries processed media (:class:`~polyrl.core.multimodal.
MultiModalInputs`) and prompt ids with *expanded* placeholder runs. The engine keeps, per
request, a :class:`SeqMedia`: where each item's run lies in the prompt, its slice of the pixel
tensor, and the prompt's M-RoPE positions. A step then needs three things from it, for the
tokens of the chunk it runs only (prefill may be chunked):

* the positions of the chunk's tokens (:meth:`SeqMedia.positions`): the prompt's precomputed
  M-RoPE table, and ``p + delta`` on all three axes for generated tokens;
* the image embeddings of the chunk's media tokens (:meth:`SeqMedia.overlapping` gives the
  rows), taken from the :class:`EmbeddingCache` so the vision tower runs once per item, not
  once per sample or chunk;
* a salt per KV block (:meth:`SeqMedia.block_salt`), mixed into the prefix cache's block keys
  so that equal token ids with different images never share keys and values.

The state hangs off the request, so forked samples, and sequences preempted and recomputed,
keep it without copying.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping

import torch

from polyrl.core.multimodal import (
    MultiModalInputError,
    MultiModalInputs,
    expand_placeholders,
    mrope_positions,
)
from polyrl.core.rollout_api import InvalidRequestError

__all__ = ["EmbeddingCache", "MediaItem", "SeqMedia", "build_seq_media"]

# The processor's pixel tensor and grid of each kind of item.
_TENSORS = {
    "image": ("pixel_values", "image_grid_thw"),
    "video": ("pixel_values_videos", "video_grid_thw"),
}


@dataclasses.dataclass(frozen=True, eq=False)
class MediaItem:
    """One image or video of a prompt.

    Attributes:
        kind: ``"image"`` or ``"video"``.
        key: cache key: the content digest plus the grid (the same picture processed at
            another resolution is another item).
        start: prompt position of the item's first token.
        length: tokens the item fills.
        pixels: the item's rows of the processor's pixel tensor.
        grid: ``(1, 3)`` its ``(t, h, w)`` patch grid.
    """

    kind: str
    key: str
    start: int
    length: int
    pixels: torch.Tensor
    grid: torch.Tensor

    @property
    def end(self) -> int:
        """Prompt position after the item's last token."""
        return self.start + self.length


class SeqMedia:
    """The media state of one request (shared by its samples).

    Args:
        items: the prompt's items in prompt order.
        positions: ``(3, prompt_len)`` M-RoPE positions of the prompt.
        delta: what generated tokens add to their index on all three axes.
    """

    def __init__(self, items: list[MediaItem], positions: torch.Tensor, delta: int):
        self.items = items
        self.prompt_len = int(positions.shape[1])
        # Python lists: a step slices a few positions per sequence, tensors would cost more.
        self._rows = [positions[i].tolist() for i in range(3)]
        self.delta = delta
        self._starts = [it.start for it in items]

    def positions(self, start: int, end: int) -> list[list[int]]:
        """``(t, h, w)`` position lists of sequence positions ``start .. end-1``."""
        n = self.prompt_len
        rows = [r[start : min(end, n)] for r in self._rows]
        if end > n:
            tail = range(max(start, n) + self.delta, end + self.delta)
            for r in rows:
                r.extend(tail)
        return rows

    def overlapping(self, start: int, end: int) -> list[tuple[MediaItem, int, int]]:
        """``(item, first row, end row)`` of each item's tokens within ``start .. end-1``."""
        out = []
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        for item in self.items[i:]:
            if item.start >= end:
                break
            lo, hi = max(start, item.start), min(end, item.end)
            if lo < hi:
                out.append((item, lo - item.start, hi - item.start))
        return out

    def block_salt(self, block: int, block_size: int) -> tuple[str, ...]:
        """Return the keys of the items with tokens in KV block ``block`` (text blocks: none).

        Blocks after an item need no salt: a block's prefix-cache key includes its parent
        block, so a different image changes every key from its block on.
        """
        lo = block * block_size
        return tuple(it.key for it, _, _ in self.overlapping(lo, lo + block_size))


def build_seq_media(
    prompt_ids: list[int],
    inputs: MultiModalInputs,
    token_ids: Mapping[str, int],
    merge_size: int,
) -> SeqMedia:
    """Check a request's media against its (expanded) prompt and build its :class:`SeqMedia`.

    Raises:
        InvalidRequestError: placeholders do not match the items, or the tensors do not
            match the grids.
    """
    try:
        expanded = expand_placeholders(prompt_ids, token_ids, inputs)
        if expanded != list(prompt_ids):
            raise MultiModalInputError(
                "prompt_ids must hold expanded placeholder runs (one token per image token) "
                "when multi_modal inputs are given"
            )
        positions, delta = mrope_positions(prompt_ids, inputs, token_ids, merge_size)
    except MultiModalInputError as exc:
        raise InvalidRequestError(str(exc), param="multi_modal") from None
    by_id = {v: k for k, v in token_ids.items()}
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(prompt_ids):
        if prompt_ids[i] in by_id:
            j = i
            while j < len(prompt_ids) and prompt_ids[j] == prompt_ids[i]:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    rows_taken = {"image": 0, "video": 0}
    grid_taken = {"image": 0, "video": 0}
    items = []
    for kind, digest, (start, length) in zip(inputs.kinds, inputs.digests, runs, strict=True):
        pix_name, grid_name = _TENSORS[kind]
        pixels, grids = inputs.tensors.get(pix_name), inputs.tensors.get(grid_name)
        if pixels is None or grids is None or grid_taken[kind] >= len(grids):
            raise InvalidRequestError(
                f"multi_modal has a {kind} but no {pix_name}/{grid_name} for it",
                param="multi_modal",
            )
        grid = grids[grid_taken[kind] : grid_taken[kind] + 1]
        rows = int(grid.prod())
        lo = rows_taken[kind]
        if lo + rows > pixels.shape[0]:
            raise InvalidRequestError(
                f"multi_modal {pix_name} has {pixels.shape[0]} rows, fewer than its grids need",
                param="multi_modal",
            )
        key = f"{kind}:{digest}:{'x'.join(str(v) for v in grid[0].tolist())}"
        items.append(MediaItem(kind, key, start, length, pixels[lo : lo + rows], grid))
        rows_taken[kind] += rows
        grid_taken[kind] += 1
    return SeqMedia(items, positions, delta)


class EmbeddingCache:
    """Vision-tower outputs by item key, least recently used dropped past ``max_bytes``.

    The ``n`` samples of a prompt, its prefill chunks and repeated prompts all ask for the same
    items; each is encoded once while it stays cached. Weight updates must :meth:`clear` it
    (the vision tower's weights change with the rest).

    Args:
        max_bytes: bound on the bytes of cached embeddings (an item larger than it is
            encoded and used, not kept).
    """

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        """Bytes of cached embeddings."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, item: MediaItem, encode: Callable[[MediaItem], torch.Tensor]) -> torch.Tensor:
        """Return ``item``'s embeddings, calling ``encode(item)`` when they are not cached."""
        with self._lock:
            hit = self._entries.get(item.key)
            if hit is not None:
                self._entries.move_to_end(item.key)
                self.hits += 1
                return hit
        emb = encode(item)
        size = emb.numel() * emb.element_size()
        with self._lock:
            self.misses += 1
            if size <= self.max_bytes and item.key not in self._entries:
                self._entries[item.key] = emb
                self._bytes += size
                while self._bytes > self.max_bytes:
                    _, old = self._entries.popitem(last=False)
                    self._bytes -= old.numel() * old.element_size()
        return emb

    def clear(self) -> None:
        """Forget every embedding (the weights changed)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
