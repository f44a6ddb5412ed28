"""Continuous-batching scheduler: which sequences run in the next step, and how many tokens each.

Every step has a token budget (``max_num_batched_tokens``) and a cap on running sequences
(``max_num_seqs``). Running sequences are served first: each decoding sequence gets its one
token, then sequences still prefilling get chunks of their prompt from what budget is left
(*chunked prefill*: a long prompt is spread over several steps and never stalls decoding).
Waiting sequences are admitted, oldest first, while budget, sequence slots and KV blocks allow;
admission first reuses cached prefix blocks. When a running sequence needs a KV block and none
is left, the most recently admitted sequence is *preempted*: its blocks are released and it
goes back to the head of the queue keeping its generated tokens, to be recomputed later.

Samples of one request (``n > 1``) after the first wait until the first has computed the
shared prompt. In the step that computes it they are *forked* from it (:meth:`Scheduler.fork`:
its full blocks shared, its partial last block copied, its logits drawn from), so they skip
the prefill; those that cannot be forked then (no free sequence slot or block) reuse its full
blocks through the prefix cache and compute the rest.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Callable
from typing import Any

from polyrl.core.rollout_api import SamplingParams
from polyrl.rollout.native.kv_cache import BlockAllocator
from polyrl.rollout.native.sampler import SamplingRow

__all__ = ["Chunk", "Scheduler", "SeqStatus", "Sequence"]


class SeqStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One sample being generated: its tokens, KV blocks and sampling state."""

    def __init__(
        self,
        seq_id: int,
        group: Any,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        max_new_tokens: int,
        row: SamplingRow,
    ):
        self.seq_id = seq_id
        self.group = group
        self.index = index
        self.tokens = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.row = row
        self.status = SeqStatus.WAITING
        self.num_computed = 0
        self.blocks: list[int] = []
        self.num_registered = 0
        self.logprobs: list[float] | None = [] if params.logprobs else None
        self.top_logprobs: list[list[tuple[int, float]]] | None = (
            [] if params.top_logprobs else None
        )
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.admit_order = -1
        self.cached_prompt_tokens = 0
        self.emitted = 0
        self.leader: Sequence | None = None
        self.weight_version = 0
        self.first_weight_version: int | None = None
        self.stop_ids: frozenset[int] = frozenset()
        # The request's images and videos (a SeqMedia, shared by its samples), or None.
        self.media: Any = None
        # The experts each position was routed to (a RouteLog), when the request asks.
        self.routes: Any = None
        # Prompt scoring (``params.prompt_logprobs``; sample 0 of a request only): per prompt
        # position its token's log-prob and top alternatives, filled as the prompt's chunks
        # run and delivered once, with the sample's first delta.
        self.prompt_scores: list[float | None] | None = None
        self.prompt_top: list[list[tuple[int, float]]] | None = None
        self.prompt_scores_sent = False

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's positions still need their logits (prompt log-probs asked)."""
        return self.prompt_scores is not None and not self.prompt_scores_sent

    @property
    def num_output(self) -> int:
        """Tokens generated so far."""
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        """Tokens not yet in the KV cache (1 while decoding)."""
        return len(self.tokens) - self.num_computed

    def output_ids(self) -> list[int]:
        """Return the generated tokens."""
        return self.tokens[self.prompt_len :]

    def block_salt(self, block: int, block_size: int) -> tuple[str, ...]:
        """Prefix-cache salt of KV block ``block``: its images' content keys (text: none)."""
        return () if self.media is None else self.media.block_salt(block, block_size)


@dataclasses.dataclass
class Chunk:
    """``length`` tokens of ``seq`` starting at position ``start`` go through this step."""

    seq: Sequence
    start: int
    length: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence (a token is sampled after it)."""
        return self.start + self.length == len(self.seq.tokens)


class Scheduler:
    """Waiting queue, running set and the per-step plan.

    Args:
        allocator: the KV block pool.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most tokens in one step.
        on_preempt: called with each preempted sequence (for metrics).
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_preempt: Callable[[Sequence], None] | None = None,
    ):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.on_preempt = on_preempt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admitted = 0

    @property
    def has_work(self) -> bool:
        """Whether any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def _blocks_needed(self, seq: Sequence, tokens: int) -> int:
        return max(0, -(-tokens // self.block_size) - len(seq.blocks))

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        """Give ``seq`` blocks for ``tokens`` tokens; False (nothing taken) if too few are free."""
        need = self._blocks_needed(seq, tokens)
        if need > self.allocator.num_free:
            return False
        for _ in range(need):
            seq.blocks.append(self.allocator.allocate())
        return True

    def release(self, seq: Sequence) -> None:
        """Return a sequence's blocks to the pool."""
        self.allocator.free(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_registered = 0

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.release(seq)
        seq.status = SeqStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        if self.on_preempt is not None:
            self.on_preempt(seq)

    def _leader_ready(self, seq: Sequence) -> bool:
        leader = seq.leader
        if leader is None:
            return True
        if leader.status is SeqStatus.FINISHED or leader.num_computed >= leader.prompt_len - 1:
            seq.leader = None
            return True
        return False

    def schedule(self) -> list[Chunk]:
        """Plan the next step (and allocate the KV blocks it writes to)."""
        budget = self.max_num_batched_tokens
        plan: list[Chunk] = []
        planned: set[int] = set()
        bs = self.block_size
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        for s in self.running:
            left = len(s.tokens) - s.num_computed
            if left == 1:
                decoding.append(s)
            elif left > 1:
                prefilling.append(s)
        for seq in decoding + prefilling:
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            length = min(len(seq.tokens) - seq.num_computed, budget)
            # Most decode steps write into a block the sequence already holds.
            fits = len(seq.blocks) * bs >= seq.num_computed + length
            while not fits and not self._grow(seq, seq.num_computed + length):
                # The most recently admitted sequence yields, even if already planned.
                victim = max(self.running, key=lambda s: s.admit_order)
                if victim is not seq and victim.seq_id in planned:
                    dropped = next(c for c in plan if c.seq is victim)
                    plan.remove(dropped)
                    planned.discard(victim.seq_id)
                    budget += dropped.length
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            plan.append(Chunk(seq, seq.num_computed, length))
            planned.add(seq.seq_id)
            budget -= length

        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not self._leader_ready(seq):
                continue
            if not seq.blocks:
                # Leave at least one token to compute: its logits give the next token. A
                # prompt to score is computed whole: cached blocks would skip its logits.
                max_blocks = 0 if seq.scores_prompt else (len(seq.tokens) - 1) // self.block_size
                salt = None
                if seq.media is not None:
                    salt = lambda b, s=seq: s.block_salt(b, self.block_size)  # noqa: E731
                seq.blocks = self.allocator.match_prefix(seq.tokens, max_blocks, salt)
                seq.num_registered = len(seq.blocks)
                seq.num_computed = len(seq.blocks) * self.block_size
                if seq.num_output == 0:
                    seq.cached_prompt_tokens = seq.num_computed
            length = min(seq.remaining, budget)
            if not self._grow(seq, seq.num_computed + length):
                self.release(seq)
                break
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            seq.admit_order = self._admitted
            self._admitted += 1
            self.running.append(seq)
            plan.append(Chunk(seq, seq.num_computed, length))
            planned.add(seq.seq_id)
            budget -= length
        return plan

    def fork(self, leader: Sequence, seq: Sequence) -> tuple[int, int] | None:
        """Start waiting sample ``seq`` from ``leader``'s computed prompt, without a prefill.

        ``leader`` has just computed its whole prompt (the same tokens as ``seq``'s) and is
        about to sample its first token. ``seq`` takes a reference to the leader's full prompt
        blocks and a block of its own for the partial last one (the caller copies its keys and
        values, see :meth:`~.kv_cache.PagedKVCache.copy_block`), and runs from the next step
        as a decoding sequence; its first token is drawn from the leader's logits. The keys,
        values and logits are those ``seq`` would compute itself: every op of the forward is
        row-wise, so a row's results do not depend on the batch around it.

        Returns:
            ``(source, destination)`` blocks to copy (``(-1, -1)``: nothing to copy), or
            ``None`` (nothing changed) when ``seq`` cannot be forked: it is not a fresh waiting
            sample of ``leader``, or no sequence slot or KV block is free.
        """
        n = seq.prompt_len
        if (
            seq.status is not SeqStatus.WAITING
            or seq.leader is not leader
            or seq.blocks
            or seq.num_output != 0
            or leader.num_output != 0
            or leader.num_computed != n
            or len(self.running) >= self.max_num_seqs
        ):
            return None
        bs = self.block_size
        full, partial = divmod(n, bs)
        if partial and self.allocator.num_free < 1:
            return None
        shared = leader.blocks[:full]
        self.allocator.share(shared)
        copy = (-1, -1)
        seq.blocks = list(shared)
        if partial:
            copy = (leader.blocks[full], self.allocator.allocate())
            seq.blocks.append(copy[1])
        # What a prefix-cache match would have reported for this sample (its full blocks).
        if self.allocator.enable_prefix_caching:
            seq.cached_prompt_tokens = full * bs
            self.allocator.hit_tokens_total += full * bs
        seq.num_computed = n
        seq.num_registered = min(leader.num_registered, full)
        seq.leader = None
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        seq.admit_order = self._admitted
        self._admitted += 1
        self.running.append(seq)
        return copy

    def commit(self, chunk: Chunk) -> None:
        """Record that a chunk's KV is written; register newly full blocks for prefix reuse."""
        seq = chunk.seq
        seq.num_computed = chunk.start + chunk.length
        full = seq.num_computed // self.block_size
        bs = self.block_size
        for b in range(seq.num_registered, full):
            parent = seq.blocks[b - 1] if b > 0 else -1
            self.allocator.register(
                seq.blocks[b], parent, seq.tokens[b * bs : (b + 1) * bs], seq.block_salt(b, bs)
            )
        seq.num_registered = max(seq.num_registered, full)
