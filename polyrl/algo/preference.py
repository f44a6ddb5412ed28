"""Preference-learning loss math: DPO and its variants, and the Bradley-Terry reward loss.

Level: the algorithm layer. Pure functions of per-pair tensors ``(P,)`` (one entry per
chosen/rejected pair); the model-engine loss functions built on them are in
:mod:`polyrl.trainer.preference_losses`.

DPO losses (:data:`DPO_LOSSES`, picked by ``loss_type`` as in TRL's ``DPOConfig``) take the
policy's and the reference's summed log-probs of each completion. With
``h = (logp_c - ref_c) - (logp_r - ref_r)``:

* ``sigmoid`` (DPO, Rafailov et al. 2023): ``-logsigmoid(beta h)``; with ``label_smoothing = e``
  (conservative DPO) ``-(1 - e) logsigmoid(beta h) - e logsigmoid(-beta h)``;
* ``ipo`` (Azar et al. 2023): ``(h - 1 / (2 beta))^2``, on *length-averaged* log-probs as TRL
  computes it;
* ``simpo`` (Meng et al. 2024), reference-free: with the length-averaged policy log-probs
  ``a_c``, ``a_r``: ``-logsigmoid(beta (a_c - a_r) - gamma)`` (label smoothing as for sigmoid).

The implicit rewards are ``beta (logp - ref)`` (``beta a`` for SimPO); a pair counts as right
when the chosen reward is the larger.

Reward models: :func:`bradley_terry_loss`, ``-logsigmoid(r_c - r_r - margin)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from polyrl.core.registry import Registry

__all__ = [
    "DPO_LOSSES",
    "DPOLossType",
    "PreferenceOutput",
    "bradley_terry_loss",
    "dpo_loss",
    "ipo_loss",
    "list_dpo_losses",
    "register_dpo_loss",
    "sigmoid_loss",
    "simpo_loss",
]


@dataclasses.dataclass(frozen=True)
class DPOLossType:
    """A registered DPO loss and what it reads.

    Attributes:
        fn: ``fn(chosen, rejected, beta=..., label_smoothing=..., simpo_gamma=...)`` returning
            per-pair losses; ``chosen`` / ``rejected`` are log-ratios to the reference, or the
            policy's own log-probs when ``reference_free``.
        reference_free: needs no reference model.
        length_normalized: reads log-probs averaged over each completion's tokens.
    """

    fn: Callable[..., torch.Tensor]
    reference_free: bool = False
    length_normalized: bool = False


#: DPO loss types by name (``dpo.loss_type``).
DPO_LOSSES: Registry[DPOLossType] = Registry("DPO loss type")
list_dpo_losses = DPO_LOSSES.names


def register_dpo_loss(
    name: str, *, reference_free: bool = False, length_normalized: bool = False
) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Register ``fn(chosen, rejected, *, beta, label_smoothing, simpo_gamma) -> losses (P,)``."""

    def deco(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        DPO_LOSSES.add(name, DPOLossType(fn, reference_free, length_normalized))
        return fn

    return deco


def _smoothed_logistic(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``-logsigmoid(x)``, mixed with ``-logsigmoid(-x)`` by ``label_smoothing``."""
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    return loss


@register_dpo_loss("sigmoid")
def sigmoid_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.0,
) -> torch.Tensor:
    """DPO: ``-logsigmoid(beta (chosen - rejected))`` on log-ratios to the reference."""
    return _smoothed_logistic(beta * (chosen - rejected), label_smoothing)


@register_dpo_loss("ipo", length_normalized=True)
def ipo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.0,
) -> torch.Tensor:
    """IPO: ``(chosen - rejected - 1 / (2 beta))^2`` on (length-averaged) log-ratios."""
    return (chosen - rejected - 1.0 / (2.0 * beta)) ** 2


@register_dpo_loss("simpo", reference_free=True, length_normalized=True)
def simpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> torch.Tensor:
    """SimPO: ``-logsigmoid(beta (chosen - rejected) - gamma)`` on average policy log-probs."""
    return _smoothed_logistic(beta * (chosen - rejected) - simpo_gamma, label_smoothing)


@dataclasses.dataclass(frozen=True)
class PreferenceOutput:
    """Per-pair results of :func:`dpo_loss`, all ``(P,)``."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor  #: implicit reward of the chosen completion (detached)
    rejected_rewards: torch.Tensor  #: implicit reward of the rejected completion (detached)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None = None,
    ref_rejected: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> PreferenceOutput:
    """Per-pair DPO-family losses and implicit rewards.

    Args:
        policy_chosen: the policy's log-prob of each chosen completion ``(P,)``, summed over its
            tokens, or averaged when the loss type is length-normalised (the caller reads
            :attr:`DPOLossType.length_normalized`).
        policy_rejected: the same for each rejected completion.
        ref_chosen: the reference model's log-probs of the chosen completions, in the same
            form; ignored (may be ``None``) by reference-free losses.
        ref_rejected: the same for the rejected completions.
        beta: the inverse temperature of the implicit reward (``> 0``).
        loss_type: a name in :data:`DPO_LOSSES`.
        label_smoothing: probability that a label is flipped (sigmoid, simpo).
        simpo_gamma: SimPO's target reward margin.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}")
    spec = DPO_LOSSES.get(loss_type)
    if policy_chosen.shape != policy_rejected.shape:
        raise ValueError(
            f"chosen and rejected log-probs differ in shape: {tuple(policy_chosen.shape)} vs "
            f"{tuple(policy_rejected.shape)}"
        )
    if spec.reference_free:
        chosen, rejected = policy_chosen, policy_rejected
    else:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"loss_type {loss_type!r} needs the reference log-probs")
        chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    losses = spec.fn(
        chosen, rejected, beta=beta, label_smoothing=label_smoothing, simpo_gamma=simpo_gamma
    )
    return PreferenceOutput(losses, beta * chosen.detach(), beta * rejected.detach())


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float = 0.0,
) -> torch.Tensor:
    """Per-pair reward-model loss ``-logsigmoid(r_c - r_r - margin)``.

    ``center_rewards_coefficient`` adds ``c (r_c + r_r)^2`` per pair (TRL's option of that name,
    Eisenstein et al. 2023), which keeps the rewards centred on zero.
    """
    if chosen_rewards.shape != rejected_rewards.shape:
        raise ValueError(
            f"chosen and rejected rewards differ in shape: {tuple(chosen_rewards.shape)} vs "
            f"{tuple(rejected_rewards.shape)}"
        )
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff)
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * (chosen_rewards + rejected_rewards) ** 2
    return loss
