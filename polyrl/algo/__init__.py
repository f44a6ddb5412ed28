"""RL algorithm building blocks: advantage estimators, policy/value losses, KL utilities.

All functions are pure torch on ``(B, T)`` tensors with a response mask; estimators and policy
losses are looked up by name through registries so configs can select them (the newer
objectives, CISPO, SAPO, GMPO, GPG, Clip-Cov and KL-Cov, live in :mod:`polyrl.algo.objectives`
and are imported the first time one is named).
"""

from polyrl.algo.advantages import (
    get_advantage_estimator,
    list_advantage_estimators,
    register_advantage,
)
from polyrl.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_loss,
    kl_penalty,
)
from polyrl.algo.losses import (
    entropy_from_logits,
    get_policy_loss,
    list_policy_losses,
    register_policy_loss,
    rollout_importance_weights,
    rollout_rejection_mask,
    value_loss,
)
from polyrl.core.numerics import AGG_MODES, agg_loss, masked_mean, masked_whiten

__all__ = [
    "AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_policy_loss",
    "kl_loss",
    "kl_penalty",
    "list_advantage_estimators",
    "list_policy_losses",
    "rollout_importance_weights",
    "rollout_rejection_mask",
    "masked_mean",
    "masked_whiten",
    "register_advantage",
    "register_policy_loss",
    "value_loss",
]
