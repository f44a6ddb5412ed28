"""PRIME (process rewards from an implicit PRM) on the bundled arithmetic task.

What it shows: a PRIME run from Python. PRIME has no trainer class of its own (the
``GRPOTrainer``-style classes each fix a different estimator): it is the ``prime`` preset
(``algorithm.adv_estimator=prime`` plus the ``prime`` option group) run by
``polyrl.trainer.rl.run_rl``, the function behind ``polyrl train prime``. Next to the policy, a
second causal LM, the implicit process reward model (engine role ``prm``, started from the
policy), is trained every step on the answers' 0/1 correctness only; its per-token log-ratio to
the frozen reference model, times ``prime.beta``, is a reward for every response token. The
advantage mixes those process rewards and the outcome score, each with a leave-one-out baseline
over the prompt's ``rollout.n`` answers (``prime.implicit_reward_coef`` /
``prime.outcome_reward_coef``). The rows and the rule-based scorer come from the config's
``data.task`` (no reward function to write). See docs/algorithms.md#prime.

Run it::

    python examples/prime_arithmetic.py --smoke     # 2 steps on a nano model (tests use this)
    python examples/prime_arithmetic.py             # the prime preset's 100 steps, CPU

The same from the command line: ``polyrl train prime``. The preset's model is a random-init tiny
one, which seldom answers a sum right early on: while every answer of a prompt gets the same
score, neither the PRM's labels nor the leave-one-out baselines tell its answers apart. At full
size pass
``--set model.path=/models/Qwen2.5-0.5B-Instruct --set trainer.device=cuda`` and your data
(``--set data.task= --set data.train_files=[train.parquet]``); ``prime.optim.lr`` then wants the
paper's small value (1e-6), as the preset's 3e-4 is for its tiny model.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from polyrl.config import load_config
from polyrl.trainer.rl import run_rl
from polyrl.trainer.tracking import read_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 tiny steps (for the tests)")
    parser.add_argument("--steps", type=int, default=0, help="0: the preset's total_steps")
    parser.add_argument("--out", default="", help="output directory (default: a temp dir)")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="polyrl-example-"))

    overrides = [
        f"trainer.output_dir={out}",
        "trainer.device=cpu",
        "trainer.worker_backend=local",  # engines as local processes, no Ray
        "prime.beta=0.05",  # the implicit reward's scale (the preset's value, shown here)
        "prime.update=before",  # train the PRM on this step's labels, then score with it
    ]
    if args.steps:
        overrides.append(f"trainer.total_steps={args.steps}")
    if args.smoke:
        # Nano model, 4 prompts x 4 answers of at most 8 tokens, no validation: seconds.
        overrides += [
            "trainer.total_steps=2",
            "model.tiny_size=nano",
            "data.num_train=32",
            "data.num_val=8",
            "data.train_batch_size=4",
            "data.max_response_length=8",
            "rollout.n=4",
            "rollout.max_new_tokens=8",
            "actor.ppo_mini_batch_size=0",  # one optimizer step per RL step
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.save_freq=0",
            "trainer.loggers=[jsonl]",
        ]
    config = load_config("prime", [*overrides, *args.set])
    summary = run_rl(config)

    # The PRM's own figures, per step, from the run's metrics file: its loss on the outcome
    # labels, and how often the sign of an answer's summed implicit reward matches its label.
    for record in read_metrics(summary["metrics"]):
        if "prime/prm_loss" in record:
            print(
                f"step {record['step']}: score {record['critic/score/mean']:.3f} "
                f"PRM loss {record['prime/prm_loss']:.4f} "
                f"PRM accuracy {record['prime/prm_accuracy']:.2f}"
            )
    print({k: summary.get(k) for k in ("steps", "first_score", "last_score", "last_val_acc")})


if __name__ == "__main__":
    main()
