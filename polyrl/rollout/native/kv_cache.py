"""Paged KV cache: a fixed pool of token blocks, per-sequence block tables, prefix caching.

The cache holds ``num_blocks * block_size`` tokens (the *token budget*) for every layer in one
preallocated tensor. A sequence owns a list of block ids; its token ``t`` lives in block
``blocks[t // block_size]`` at offset ``t % block_size``.

Prefix caching shares *full* blocks between sequences with the same leading tokens. A full,
computed block is registered under a key made of its parent block's identity and its own token
ids, so a match is exact (token ids are compared, no hash can collide). When the last user of a
registered block lets go of it, the block stays cached and becomes *evictable*: it is reused by
a later prefix match, or reclaimed (least recently used first) when the pool runs dry. Shared
blocks are never written to: a sequence only writes positions past its matched prefix, which lie
in blocks of its own.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import torch

__all__ = ["BlockAllocator", "NoFreeBlocksError", "PagedKVCache"]


class NoFreeBlocksError(RuntimeError):
    """The pool has no free or evictable block left."""


# A registered block's key: (parent block id, parent generation, token ids, salt); -1 / 0 for
# the first block. The parent's generation changes whenever that block id is re-registered with
# other content, so keys of stale children can never match again. The salt holds the content
# keys of the images whose tokens lie in the block (placeholder ids are equal for all images).
_BlockKey = tuple[int, int, tuple[int, ...], tuple[str, ...]]
BlockSalt = Callable[[int], tuple[str, ...]]
"""Gives the salt of block ``b`` of a sequence."""


class BlockAllocator:
    """Reference-counted block ids with optional exact prefix caching.

    Args:
        num_blocks: size of the pool.
        block_size: tokens per block.
        enable_prefix_caching: keep full blocks for reuse by later sequences.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._key: list[_BlockKey | None] = [None] * num_blocks
        self._generation = [0] * num_blocks
        self._by_key: dict[_BlockKey, int] = {}
        self.hit_tokens_total = 0

    @property
    def num_free(self) -> int:
        """Blocks available to :meth:`allocate` (free plus evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Registered blocks nobody references (kept for prefix reuse)."""
        return len(self._evictable)

    def allocate(self) -> int:
        """Take one block (reference count 1), evicting the oldest cached block if needed.

        Raises:
            NoFreeBlocksError: every block is referenced.
        """
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._unregister(block)
        else:
            raise NoFreeBlocksError("no free KV-cache block")
        self._refs[block] = 1
        return block

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced blocks become free or evictable."""
        for block in blocks:
            refs = self._refs[block] - 1
            if refs < 0:
                raise RuntimeError(f"KV block {block} freed more often than allocated")
            self._refs[block] = refs
            if refs == 0:
                if self._key[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def share(self, blocks: Sequence[int]) -> None:
        """Take one more reference to each of ``blocks``, which must be referenced already.

        Used to hand a sequence's computed prompt blocks to a sibling sample (see
        :meth:`polyrl.rollout.native.scheduler.Scheduler.fork`); works with prefix caching
        off too, since nothing is looked up.
        """
        for block in blocks:
            if self._refs[block] <= 0:
                raise RuntimeError(f"KV block {block} is not referenced; it cannot be shared")
        for block in blocks:
            self._refs[block] += 1

    def _unregister(self, block: int) -> None:
        key = self._key[block]
        if key is not None:
            if self._by_key.get(key) == block:
                del self._by_key[key]
            self._key[block] = None
            self._generation[block] += 1

    def block_key(
        self, parent: int, tokens: Sequence[int], salt: tuple[str, ...] = ()
    ) -> _BlockKey:
        """Return the key of a block holding ``tokens`` after block ``parent`` (-1: none).

        ``salt`` names content the token ids do not show (the images at image tokens).
        """
        gen = self._generation[parent] if parent >= 0 else 0
        return (parent, gen, tuple(tokens), salt)

    def match_prefix(
        self, tokens: Sequence[int], max_blocks: int, salt: BlockSalt | None = None
    ) -> list[int]:
        """Take a reference to the cached blocks holding the longest prefix of ``tokens``.

        At most ``max_blocks`` full blocks are matched. Matched blocks get one more reference
        each (they leave the evictable set). ``salt(b)`` gives block ``b``'s salt (see
        :meth:`block_key`).
        """
        if not self.enable_prefix_caching or max_blocks <= 0:
            return []
        bs = self.block_size
        matched: list[int] = []
        parent = -1
        for b in range(max_blocks):
            key = self.block_key(
                parent, tokens[b * bs : (b + 1) * bs], salt(b) if salt is not None else ()
            )
            block = self._by_key.get(key)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            matched.append(block)
            parent = block
        self.hit_tokens_total += len(matched) * bs
        return matched

    def register(
        self, block: int, parent: int, tokens: Sequence[int], salt: tuple[str, ...] = ()
    ) -> None:
        """Record that ``block`` now holds ``tokens`` (a full block) after block ``parent``.

        A block already registered, or content already cached in another block, is left alone.
        ``salt``: see :meth:`block_key`.
        """
        if not self.enable_prefix_caching or self._key[block] is not None:
            return
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks are cached, got {len(tokens)} tokens")
        key = self.block_key(parent, tokens, salt)
        if key in self._by_key:
            return
        self._key[block] = key
        self._by_key[key] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after a weight update its KV values are stale)."""
        for block in list(self._evictable):
            self._unregister(block)
            self._free.append(block)
        self._evictable.clear()
        for block in range(self.num_blocks):
            self._unregister(block)


class PagedKVCache:
    """Preallocated key/value storage for every layer, addressed by block id.

    ``k(layer)`` and ``v(layer)`` are ``(num_blocks, block_size, kv_heads, head_dim)`` views of
    one tensor. :meth:`release` frees the memory (engine sleep) and :meth:`allocate` brings it
    back, zeroed.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = device
        self._data: torch.Tensor | None = None
        # (keys, values) view of each layer, made once per allocation: the forward asks for
        # them every layer and step, and indexing a tensor costs microseconds each time.
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.allocate()

    @property
    def allocated(self) -> bool:
        """Whether the storage is held."""
        return self._data is not None

    @property
    def nbytes(self) -> int:
        """Bytes held now (0 when released)."""
        return 0 if self._data is None else self._data.numel() * self._data.element_size()

    def allocate(self) -> None:
        """(Re)create the storage if it was released."""
        if self._data is None:
            self._data = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self._views = [(self._data[i, 0], self._data[i, 1]) for i in range(self.shape[0])]

    def release(self) -> None:
        """Drop the storage so its memory can be reused."""
        self._data = None
        self._views = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _storage(self) -> torch.Tensor:
        if self._data is None:
            raise RuntimeError("the KV cache is released (engine asleep); wake it up first")
        return self._data

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s keys and values into block ``dst``, in every layer."""
        data = self._storage()
        data[:, :, dst] = data[:, :, src]

    def k(self, layer: int) -> torch.Tensor:
        """Keys of ``layer``: ``(num_blocks, block_size, kv_heads, head_dim)``."""
        if self._views:
            return self._views[layer][0]
        return self._storage()[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        """Values of ``layer``: ``(num_blocks, block_size, kv_heads, head_dim)``."""
        if self._views:
            return self._views[layer][1]
        return self._storage()[layer, 1]
