"""Images and videos in the native engine: per-sequence media state and the embedding cache.

A vision-language request carries processed media (:class:`~polyrl.core.multimodal.
MultiModalInputs`) and prompt ids with *expanded* placeholders. The engine keeps, per request, a
:class:`SeqMedia`: where each item's expansion and its image-token runs lie in the prompt, its
slice of the processed tensors (the family's :meth:`~polyrl.models.vision_family.VisionFamily.
split_items`), and, for M-RoPE families, the prompt's positions. A step then needs three things
from it, for the tokens of the chunk it runs only (prefill may be chunked):

* M-RoPE families: the positions of the chunk's tokens (:meth:`SeqMedia.positions`): the
  prompt's precomputed table, and ``p + delta`` on all three axes for generated tokens;
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
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from polyrl.core.multimodal import MultiModalInputError, MultiModalInputs, locate_media
from polyrl.core.rollout_api import InvalidRequestError
from polyrl.models.vision_family import VisionFamily

__all__ = ["EmbeddingCache", "MediaItem", "SeqMedia", "build_seq_media"]


@dataclasses.dataclass(frozen=True, eq=False)
class MediaItem:
    """One image or video of a prompt.

    Attributes:
        kind: ``"image"`` or ``"video"``.
        key: cache key: the content digest plus the processed layout (the same picture
            processed at another resolution is another item).
        start: prompt position of the item's expansion's first token.
        span: tokens of its expansion (image-token runs and the family's markers).
        length: embedding tokens (the vision tower's output rows).
        runs: ``(prompt position, first embedding row, rows)`` of each image-token run, in
            order (Qwen2-VL: one run; SmolVLM: one per tile).
        tensors: the item's part of the processed tensors, what the vision tower takes.
    """

    kind: str
    key: str
    start: int
    span: int
    length: int
    runs: tuple[tuple[int, int, int], ...]
    tensors: dict[str, torch.Tensor]

    @property
    def end(self) -> int:
        """Prompt position after the item's expansion."""
        return self.start + self.span


class SeqMedia:
    """The media state of one request (shared by its samples).

    Args:
        items: the prompt's items in prompt order.
        prompt_len: tokens of the prompt.
        positions: ``(3, prompt_len)`` M-RoPE positions of the prompt (``None``: the family
            uses 1-D positions).
        delta: what generated tokens add to their index on all three axes.
    """

    def __init__(
        self,
        items: list[MediaItem],
        prompt_len: int,
        positions: torch.Tensor | None = None,
        delta: int = 0,
    ):
        self.items = items
        self.prompt_len = prompt_len
        # Python lists: a step slices a few positions per sequence, tensors would cost more.
        self._rows = None if positions is None else [positions[i].tolist() for i in range(3)]
        self.delta = delta
        self._starts = [it.start for it in items]

    def positions(self, start: int, end: int) -> list[list[int]]:
        """``(t, h, w)`` position lists of sequence positions ``start .. end-1``."""
        n = self.prompt_len
        if self._rows is None:
            return [list(range(start, end)) for _ in range(3)]
        rows = [r[start : min(end, n)] for r in self._rows]
        if end > n:
            tail = range(max(start, n) + self.delta, end + self.delta)
            for r in rows:
                r.extend(tail)
        return rows

    def _touching(self, start: int, end: int) -> list[MediaItem]:
        out = []
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        for item in self.items[i:]:
            if item.start >= end:
                break
            if item.end > start:
                out.append(item)
        return out

    def overlapping(self, start: int, end: int) -> list[tuple[MediaItem, int, int, int]]:
        """``(item, position, first row, end row)`` of embedding rows within ``start .. end-1``.

        ``position`` is where the first of those rows goes; one entry per image-token run
        piece (a prefill chunk may cut a run).
        """
        out = []
        for item in self._touching(start, end):
            for pos, row, n in item.runs:
                lo, hi = max(start, pos), min(end, pos + n)
                if lo < hi:
                    out.append((item, lo, row + lo - pos, row + hi - pos))
        return out

    def block_salt(self, block: int, block_size: int) -> tuple[str, ...]:
        """Return the keys of the items with tokens in KV block ``block`` (text blocks: none).

        Blocks after an item need no salt: a block's prefix-cache key includes its parent
        block, so a different image changes every key from its block on.
        """
        lo = block * block_size
        return tuple(it.key for it in self._touching(lo, lo + block_size))


def build_seq_media(
    prompt_ids: list[int], inputs: MultiModalInputs, family: VisionFamily
) -> SeqMedia:
    """Check a request's media against its (expanded) prompt and build its :class:`SeqMedia`.

    Raises:
        InvalidRequestError: placeholders do not match the items, or the tensors do not
            match the items.
    """
    token_ids = family.token_ids
    try:
        expanded, starts = locate_media(prompt_ids, token_ids, inputs)
        if expanded != list(prompt_ids):
            raise MultiModalInputError(
                "prompt_ids must hold expanded placeholders (one token per image token) "
                "when multi_modal inputs are given"
            )
        found = family.positions(prompt_ids, inputs)
        parts = family.split_items(inputs)
    except MultiModalInputError as exc:
        raise InvalidRequestError(str(exc), param="multi_modal") from None
    items = []
    for k, (kind, digest, start, (tensors, shape)) in enumerate(
        zip(inputs.kinds, inputs.digests, starts, parts, strict=True)
    ):
        placeholder = token_ids[kind]
        expansion = inputs.expansion(k, placeholder)
        # (prompt position, first embedding row, length) of each placeholder run.
        runs: list[tuple[int, int, int]] = []
        row = at = 0
        for token, group in itertools.groupby(expansion):
            length = sum(1 for _ in group)
            if token == placeholder:
                runs.append((start + at, row, length))
                row += length
            at += length
        items.append(
            MediaItem(
                kind=kind,
                key=f"{kind}:{digest}:{shape}",
                start=start,
                span=len(expansion),
                length=row,
                runs=tuple(runs),
                tensors=tensors,
            )
        )
    if found is None:
        return SeqMedia(items, len(prompt_ids))
    positions, delta = found
    return SeqMedia(items, len(prompt_ids), positions, delta)


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
