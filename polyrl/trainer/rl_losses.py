"""The RL losses, kept importable here for user code: they live in :mod:`polyrl.workers.rl_losses`.

The engine workers may not import the trainer layer, so the losses moved to the glue layer,
where they are registered by name (:mod:`polyrl.workers.losses`).
"""

from polyrl.workers.rl_losses import actor_loss, critic_loss, prm_loss, state_values

__all__ = ["actor_loss", "critic_loss", "prm_loss", "state_values"]
