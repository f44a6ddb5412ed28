"""The RL trainer, read in this order.

* :mod:`~polyrl.trainer.rl.loop` -- :class:`RLTrainer`: set-up, the step (once), validation,
  checkpoints, the run;
* :mod:`~polyrl.trainer.rl.generation` -- the generation phase (driver or queue workers,
  ReMax baseline, DAPO filtering, replica sleep/wake);
* :mod:`~polyrl.trainer.rl.dataplane` -- where the step's rows live between phases;
* :mod:`~polyrl.trainer.rl.advantage` -- the advantage phase;
* :mod:`~polyrl.trainer.rl.rollout` -- sampling and scoring through the rollout client;
* :mod:`~polyrl.trainer.rl.store_worker` -- the transfer queue's rollout workers;
* :mod:`~polyrl.trainer.rl.metrics` -- what a step reports;
* :mod:`~polyrl.trainer.rl.settings` -- every ``auto`` of the config, resolved once;
* :mod:`~polyrl.trainer.rl.checks` -- the config's checks, before anything starts;
* :mod:`~polyrl.trainer.rl.build` -- the wiring, run once at set-up.
"""

from polyrl.trainer.rl.build import rollout_matmul_dtype, trains_on_gpu
from polyrl.trainer.rl.loop import RLTrainer, run_rl
from polyrl.trainer.rl.metrics import DEFAULT_PLOT_METRICS

__all__ = ["DEFAULT_PLOT_METRICS", "RLTrainer", "rollout_matmul_dtype", "run_rl", "trains_on_gpu"]
