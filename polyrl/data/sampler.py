"""A batch sampler whose exact position can be checkpointed and restored."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import Sampler


class StatefulSampler(Sampler[list[int]]):
    """Yields batches of dataset indices, epoch after epoch, resumable mid-epoch.

    Each epoch visits a permutation of ``range(num_items)`` derived only from ``(seed, epoch)``
    (or the identity when ``shuffle=False``), cut into batches of ``batch_size``.  The sampler
    remembers how many batches of the current epoch were handed out; :meth:`state_dict` captures
    that, and a sampler given it with :meth:`load_state_dict` yields exactly the batches the
    original would have yielded next.

    Iterating (``for batch in sampler``) yields the *remaining* batches of the current epoch and
    then moves to the next epoch, so a ``DataLoader(dataset, batch_sampler=sampler)`` works as
    usual, one epoch per ``for`` loop.  :meth:`next_batch` crosses epoch boundaries on its own.

    The sampler is meant for a single consumer: two live iterators share one position.  A
    ``DataLoader`` with ``num_workers > 0`` draws batches ahead of the training loop (up to
    ``num_workers * prefetch_factor``), so the position then counts batches *requested*, not
    consumed; for exact resume use ``num_workers=0`` or call :meth:`next_batch` yourself.

    Args:
        num_items: Dataset size.
        batch_size: Indices per batch.
        shuffle: Permute each epoch; otherwise indices come in order.
        seed: Base seed of the per-epoch permutations.
        drop_last: Drop the final short batch of an epoch; otherwise yield it.
    """

    def __init__(
        self,
        num_items: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        for name, value in (("num_items", num_items), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if drop_last and num_items < batch_size:
            raise ValueError(
                f"num_items ({num_items}) < batch_size ({batch_size}) with drop_last=True "
                "gives no batch at all; lower batch_size or set drop_last=False"
            )
        super().__init__()
        self.num_items = int(num_items)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.position = 0  # batches of `epoch` already handed out
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    @property
    def batches_per_epoch(self) -> int:
        """Number of batches in one epoch."""
        if self.drop_last:
            return self.num_items // self.batch_size
        return -(-self.num_items // self.batch_size)

    def __len__(self) -> int:
        """Batches per epoch (what ``DataLoader`` reports as its length)."""
        return self.batches_per_epoch

    def permutation(self, epoch: int) -> np.ndarray:
        """Return the index order of ``epoch`` (a fresh array; depends only on seed and epoch)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if self._perm_epoch != epoch:
            if self.shuffle:
                # Seeding with the pair keeps (seed=0, epoch=1) and (seed=1, epoch=0) distinct.
                rng = np.random.default_rng([self.seed, epoch])
                self._perm = rng.permutation(self.num_items)
            else:
                self._perm = np.arange(self.num_items)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm.copy()

    def _batch(self, epoch: int, position: int) -> list[int]:
        perm = self.permutation(epoch)
        start = position * self.batch_size
        return perm[start : start + self.batch_size].tolist()

    def next_batch(self) -> list[int]:
        """Hand out the next batch and advance, rolling into the next epoch when one ends."""
        batch = self._batch(self.epoch, self.position)
        self.position += 1
        if self.position >= self.batches_per_epoch:
            # Advance before the caller sees the last batch so a state_dict taken right after
            # it already points at the next epoch.
            self.epoch += 1
            self.position = 0
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        """Yield the remaining batches of the current epoch."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Return the position (epoch, batches consumed) and the settings it is valid for."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_items": self.num_items,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`.

        Raises:
            ValueError: If keys are missing, the position is out of range, or the state was
                saved by a sampler with different settings (its position would be meaningless).
        """
        required = ("epoch", "position", "num_items", "batch_size", "shuffle", "seed", "drop_last")
        missing = [k for k in required if k not in state]
        if missing:
            raise ValueError(f"sampler state is missing keys {missing}; got {sorted(state)}")
        mismatched = {
            k: (state[k], getattr(self, k))
            for k in ("num_items", "batch_size", "shuffle", "seed", "drop_last")
            if state[k] != getattr(self, k)
        }
        if mismatched:
            detail = ", ".join(
                f"{k}: saved {s!r} vs this sampler {c!r}" for k, (s, c) in mismatched.items()
            )
            raise ValueError(f"sampler state was saved with different settings ({detail})")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.batches_per_epoch:
            raise ValueError(
                f"sampler state out of range: epoch={epoch}, position={position} "
                f"(expected epoch >= 0 and 0 <= position < {self.batches_per_epoch})"
            )
        self.epoch, self.position = epoch, position
