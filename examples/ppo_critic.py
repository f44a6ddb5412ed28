"""PPO with a critic (value model) and GAE advantages, on a bundled generated task.

What it shows: ``polyrl.PPOTrainer`` driven entirely by the ``ppo`` preset plus overrides. The
critic starts from the policy model with a fresh value head (``critic.model_path`` empty);
advantages are GAE (``algorithm.gamma``, ``algorithm.lam``), the KL to the reference model is
subtracted from the reward (``algorithm.use_kl_in_reward``), and the critic is trained with the
clipped value loss (``critic.cliprange_value``). With no ``model.path`` a tiny random-init model
is built from ``model.tiny_arch`` / ``model.tiny_size``; ``data.task`` generates the data.

Run it::

    python examples/ppo_critic.py --smoke     # 2 steps on a nano model (tests use this)
    python examples/ppo_critic.py             # the ppo preset's 100 steps, CPU

The same run from the command line: ``polyrl train ppo trainer.total_steps=50``. At full size:
``--set model.path=/models/Qwen2.5-0.5B-Instruct --set data.task= --set
data.train_files=[train.parquet] --set trainer.device=cuda``.
"""

from __future__ import annotations

import argparse
import tempfile

from polyrl import PPOTrainer
from polyrl.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 tiny steps (for the tests)")
    parser.add_argument("--out", default="", help="output directory (default: a temp dir)")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="polyrl-example-")

    overrides = [
        f"trainer.output_dir={out}",
        "trainer.device=cpu",
        "trainer.worker_backend=local",
        "critic.optim.lr=1e-3",  # the critic's own optimizer settings
        "critic.ppo_epochs=2",
        "trainer.critic_warmup=0",  # steps that train only the critic first
    ]
    if args.smoke:
        overrides += [
            "model.tiny_size=nano",
            "trainer.total_steps=2",
            "trainer.test_freq=0",
            "trainer.save_freq=0",
            "data.num_train=32",
            "data.num_val=8",
            "actor.ppo_epochs=1",
            "critic.ppo_epochs=1",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "rollout.n=2",
            "data.max_response_length=8",
            "rollout.max_new_tokens=8",
        ]
    config = load_config("ppo", [*overrides, *args.set])
    # model=None: build the tiny model the config describes (or pass an HF directory).
    summary = PPOTrainer(model=None, config=config).train()
    print({k: summary.get(k) for k in ("steps", "first_score", "last_score", "hf_model")})


if __name__ == "__main__":
    main()
