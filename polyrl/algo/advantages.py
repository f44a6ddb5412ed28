"""Advantage estimators for RL post-training, kept in a name-keyed registry.

Every estimator takes ``token_level_rewards (B, T)`` and ``response_mask (B, T)`` plus, where it
needs them, ``index`` (group id per row), ``values (B, T)`` or ``baseline_rewards (B,)``, and
returns ``(advantages, returns)``, both ``(B, T)`` and zero wherever the mask is zero.
Let ``s_i = sum_t r_{i,t}`` be the sequence score.

- ``gae``: ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``,
  ``R_t = A_t + V_t``; optionally whitened over the batch.
- ``grpo``: ``A_i = (s_i - mean_g(s)) / (std_g(s) + eps)`` within a group g (Bessel std);
  ``norm_adv_by_std=False`` is the Dr. GRPO variant ``A_i = s_i - mean_g(s)``.
- ``rloo``: ``A_i = s_i - mean_{j in g, j != i} s_j``.
- ``reinforce_plus_plus``: ``G_t = r_t + gamma * G_{t+1}``, ``A = whiten(G)`` over the batch.
- ``reinforce_plus_plus_baseline``: ``A = whiten(s_i - mean_g(s))`` broadcast over tokens.
- ``remax``: ``G_t = sum_{k>=t} r_k``, ``A_t = G_t - b_i`` with ``b_i`` the greedy rollout's score.
- ``turn_grpo``: per-turn discounted returns ``G_{i,t}`` of the turns' rewards (contiguous
  mask runs), each turn's tokens get ``(G_{i,t} - mean) / std`` over the same turn of the group.
- ``prime``: PRIME's leave-one-out combination of implicit process rewards ``p_{i,t}`` (from
  :mod:`polyrl.algo.prime`) and outcome scores: ``A_{i,t} = c_p * sum_{k>=t} (p_{i,k} -
  mean_{j != i} pbar_j) + c_o * (s_i - mean_{j != i} s_j)`` with ``pbar_j`` the mean token
  reward of response ``j``, then whitened over the batch's tokens.

Groups of size 1 carry no relative signal, so group-based estimators give them advantage 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from polyrl.core.numerics import masked_whiten
from polyrl.core.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

#: Advantage estimators by name.
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")
register_advantage = ADVANTAGE_ESTIMATORS.register
get_advantage_estimator = ADVANTAGE_ESTIMATORS.get
list_advantage_estimators = ADVANTAGE_ESTIMATORS.names


def _check(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be (B, T), got shape {tuple(rewards.shape)}")
    if mask.shape != rewards.shape:
        raise ValueError(
            f"response_mask shape {tuple(mask.shape)} must equal token_level_rewards shape "
            f"{tuple(rewards.shape)}"
        )
    return mask.to(rewards.dtype)


def _group_ids(index: Any, batch: int) -> torch.Tensor:
    """Map arbitrary hashable group ids (list/array/tensor) to dense int64 ids."""
    if index is None:
        raise ValueError("this estimator needs `index` (one group id per row), got None")
    if isinstance(index, torch.Tensor):
        items: Sequence[Any] = index.tolist()
    else:
        items = list(index)
    if len(items) != batch:
        raise ValueError(f"index has {len(items)} entries, expected one per row ({batch})")
    dense: dict[Any, int] = {}
    ids = [dense.setdefault(x if not isinstance(x, list) else tuple(x), len(dense)) for x in items]
    return torch.tensor(ids, dtype=torch.long)


def _group_stats(
    scores: torch.Tensor, gid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group size, group mean and group Bessel std (std 0 for singletons)."""
    ngroups = int(gid.max().item()) + 1 if gid.numel() else 0
    count = torch.zeros(ngroups, dtype=scores.dtype).index_add_(0, gid, torch.ones_like(scores))
    total = torch.zeros(ngroups, dtype=scores.dtype).index_add_(0, gid, scores)
    mean = total / count
    sq = torch.zeros(ngroups, dtype=scores.dtype).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = (sq / (count - 1).clamp(min=1.0)).sqrt()
    return count[gid], mean[gid], std[gid]


@register_advantage("gae")
def gae(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation; ``values`` (B, T) from the critic are required.

    Masked positions are skipped: the recursion carries through them unchanged, so a gap in
    the mask behaves as if the masked tokens were absent. Values after the last token are 0.
    """
    mask = _check(token_level_rewards, response_mask)
    if values is None or values.shape != token_level_rewards.shape:
        raise ValueError(
            "gae needs `values` with the same (B, T) shape as token_level_rewards, got "
            f"{None if values is None else tuple(values.shape)}"
        )
    with torch.no_grad():
        B, T = token_level_rewards.shape
        lastgae = torch.zeros(B, dtype=token_level_rewards.dtype)
        nextvalue = torch.zeros(B, dtype=token_level_rewards.dtype)
        out = torch.zeros_like(token_level_rewards)
        for t in reversed(range(T)):
            m = mask[:, t]
            delta = token_level_rewards[:, t] + gamma * nextvalue - values[:, t]
            new = delta + gamma * lam * lastgae
            lastgae = m * new + (1 - m) * lastgae
            nextvalue = m * values[:, t] + (1 - m) * nextvalue
            out[:, t] = lastgae
        returns = (out + values) * mask
        adv = masked_whiten(out, mask) if whiten else out * mask
    return adv, returns


@register_advantage("grpo")
def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    *,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative outcome advantage; ``norm_adv_by_std=False`` gives Dr. GRPO."""
    mask = _check(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        count, mean, std = _group_stats(scores, _group_ids(index, scores.shape[0]))
        adv = scores - mean
        if norm_adv_by_std:
            adv = adv / (std + eps)
        adv = torch.where(count > 1, adv, torch.zeros_like(adv))
        out = adv.unsqueeze(-1) * mask
    return out, out.clone()


@register_advantage("rloo")
def rloo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: baseline is the mean score of the other group members."""
    mask = _check(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        count, mean, _ = _group_stats(scores, _group_ids(index, scores.shape[0]))
        # s_i - (n*mean - s_i)/(n-1) == n/(n-1) * (s_i - mean)
        adv = count / (count - 1).clamp(min=1.0) * (scores - mean)
        adv = torch.where(count > 1, adv, torch.zeros_like(adv))
        out = adv.unsqueeze(-1) * mask
    return out, out.clone()


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    B, T = rewards.shape
    running = torch.zeros(B, dtype=rewards.dtype)
    out = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        running = rewards[:, t] * mask[:, t] + gamma * running
        out[:, t] = running
    return out * mask


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted token returns, whitened over all masked tokens of the batch."""
    mask = _check(token_level_rewards, response_mask)
    with torch.no_grad():
        returns = _discounted_returns(token_level_rewards, mask, gamma)
        adv = masked_whiten(returns, mask)
    return adv, returns


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline, then whitening over the batch's tokens."""
    mask = _check(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        count, mean, _ = _group_stats(scores, _group_ids(index, scores.shape[0]))
        centred = torch.where(count > 1, scores - mean, torch.zeros_like(scores))
        adv = masked_whiten(centred.unsqueeze(-1) * mask, mask)
    return adv, adv.clone()


@register_advantage("remax")
def remax(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: undiscounted return-to-go minus the greedy rollout's score ``baseline_rewards``."""
    mask = _check(token_level_rewards, response_mask)
    B = token_level_rewards.shape[0]
    if baseline_rewards is None or baseline_rewards.reshape(-1).shape[0] != B:
        raise ValueError(
            f"remax needs `baseline_rewards` with one value per row ({B}), got "
            f"{None if baseline_rewards is None else tuple(baseline_rewards.shape)}"
        )
    with torch.no_grad():
        returns = _discounted_returns(token_level_rewards, mask, 1.0)
        adv = (returns - baseline_rewards.reshape(B, 1).to(returns.dtype)) * mask
    return adv, returns


@register_advantage("prime")
def prime(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    *,
    process_rewards: torch.Tensor | None = None,
    implicit_coef: float = 1.0,
    outcome_coef: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PRIME: RLOO on the implicit process rewards and on the outcome score, summed (gamma 1).

    ``process_rewards (B, T)`` are the PRM's token rewards. As in the PRIME paper (eq. 5), the
    leave-one-out baseline of response ``i``'s process rewards is the mean, over the group's
    other responses, of their *average* token reward; each token's process return is the sum
    of the baselined rewards from it to the end. The outcome part is RLOO on the sequence score
    and is the same on every token. ``returns`` is the weighted sum before whitening.
    """
    mask = _check(token_level_rewards, response_mask)
    if process_rewards is None or process_rewards.shape != token_level_rewards.shape:
        raise ValueError(
            "prime needs `process_rewards` with the same (B, T) shape as token_level_rewards, "
            f"got {None if process_rewards is None else tuple(process_rewards.shape)}"
        )
    with torch.no_grad():
        gid = _group_ids(index, token_level_rewards.shape[0])
        process = process_rewards.to(token_level_rewards.dtype) * mask
        per_row = process.sum(-1) / mask.sum(-1).clamp(min=1.0)
        count, mean, _ = _group_stats(per_row, gid)
        others = (count * mean - per_row) / (count - 1).clamp(min=1.0)
        process_returns = _discounted_returns(process - others.unsqueeze(-1) * mask, mask, 1.0)
        scores = token_level_rewards.sum(-1)
        _, score_mean, _ = _group_stats(scores, gid)
        outcome = count / (count - 1).clamp(min=1.0) * (scores - score_mean)
        combined = implicit_coef * process_returns + outcome_coef * outcome.unsqueeze(-1) * mask
        # A lone response has no baseline: no signal from it, as in rloo.
        returns = torch.where((count > 1).unsqueeze(-1), combined, torch.zeros_like(combined))
        adv = masked_whiten(returns, mask) if whiten else returns.clone()
    return adv, returns


def turn_spans(mask_row: torch.Tensor) -> list[tuple[int, int]]:
    """Return the ``[start, end)`` spans of the contiguous nonzero runs of one mask row.

    In an agent trajectory each run is one model turn: turns are separated by the tool or
    environment tokens (mask 0) between them.
    """
    on = (mask_row != 0).to(torch.int8)
    edges = torch.diff(on, prepend=on.new_zeros(1), append=on.new_zeros(1))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, ends, strict=True))


@register_advantage("turn_grpo")
def turn_grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    *,
    gamma: float = 1.0,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-turn discounted returns with per-turn group baselines (multi-turn credit).

    Turns are the contiguous runs of the mask (:func:`turn_spans`); turn ``t``'s reward
    ``r_{i,t}`` is the sum of the token rewards in its run (the trainer puts each environment
    step's reward on the last token of the turn it answered). Then

    ``G_{i,t} = sum_{k>=t} gamma^(k-t) r_{i,k}``, and every token of turn ``t`` of row ``i``
    gets ``A = (G_{i,t} - mean_{j in g, t}(G)) / (std_{j in g, t}(G) + eps)``: the mean and
    Bessel std over the rows of ``i``'s group that have a turn ``t`` (``norm_adv_by_std=False``:
    no division). A (group, turn) with a single row gives 0, as GRPO's singleton groups do.
    ``returns`` holds ``G`` on the turn's tokens.

    With one turn per row and ``gamma=1`` this is ``grpo``. With several, an early turn is
    judged by what followed it (its return) against the same turn of the other attempts of the
    prompt, instead of every token sharing the trajectory's total.
    """
    mask = _check(token_level_rewards, response_mask)
    with torch.no_grad():
        B = token_level_rewards.shape[0]
        gid = _group_ids(index, B).tolist()
        spans = [turn_spans(mask[i]) for i in range(B)]
        returns_of: list[list[float]] = []
        for i in range(B):
            rewards = [float(token_level_rewards[i, a:b].sum()) for a, b in spans[i]]
            g, out = 0.0, []
            for r in reversed(rewards):
                g = r + gamma * g
                out.append(g)
            returns_of.append(out[::-1])
        # Every (row, turn) return, grouped by (prompt group, turn index): _group_stats then
        # gives each its peers' count, mean and Bessel std.
        keys: dict[tuple[int, int], int] = {}
        entries = [(i, t, g) for i in range(B) for t, g in enumerate(returns_of[i])]
        flat = torch.tensor([g for _, _, g in entries], dtype=torch.float64)
        key_ids = torch.tensor(
            [keys.setdefault((gid[i], t), len(keys)) for i, t, _ in entries], dtype=torch.long
        )
        count, mean, std = _group_stats(flat, key_ids)
        adv = torch.zeros_like(token_level_rewards)
        ret = torch.zeros_like(token_level_rewards)
        for k, (i, t, g) in enumerate(entries):
            a, b = spans[i][t]
            ret[i, a:b] = g
            if count[k] < 2:
                continue
            value = g - float(mean[k])
            if norm_adv_by_std:
                value /= float(std[k]) + eps
            adv[i, a:b] = value
        adv = adv * mask
        ret = ret * mask
    return adv, ret
