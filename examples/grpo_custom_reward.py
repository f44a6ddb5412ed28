"""GRPO from Python on your own rows with your own reward function.

What it shows: ``polyrl.GRPOTrainer`` trained on a list of verl-schema rows (``prompt``,
``data_source``, ``reward_model.ground_truth``) and a plain Python callable as the reward. The
callable receives the arguments it names (here the verl ones: ``data_source``, ``solution_str``,
``ground_truth``, ``extra_info``) and returns a float or a dict with a ``"score"`` key.

The task: answer with the word given in the prompt, spelled backwards. The reward is the share of
characters in the right place, so a random model gets a dense signal.

The critic-free trainers take the same arguments and differ only in the advantage estimator, so
``--trainer`` swaps GRPO for one of them (each starts from its own preset):

* ``grpo`` (``GRPOTrainer``): rewards normalised within each prompt's ``rollout.n`` responses;
* ``rloo`` (``RLOOTrainer``): each response's baseline is the mean of the prompt's others;
* ``reinforce_plus_plus`` (``REINFORCEPlusPlusTrainer``): returns whitened over the batch;
* ``remax`` (``ReMaxTrainer``): the greedy response's reward is the baseline (one sample each).

Run it::

    python examples/grpo_custom_reward.py --smoke      # 2 steps on a nano model (tests use this)
    python examples/grpo_custom_reward.py              # 30 steps on a micro model, CPU
    python examples/grpo_custom_reward.py --trainer rloo   # same task, another estimator

At full size, pass a real model and device, e.g.
``--model /models/Qwen2.5-0.5B-Instruct --steps 200 --set trainer.device=cuda``; every ``--set``
is a ``key=value`` config override (``polyrl config describe`` lists them all).
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from polyrl import GRPOTrainer, REINFORCEPlusPlusTrainer, ReMaxTrainer, RLOOTrainer
from polyrl.config import load_config

LETTERS = "abcdefgh"

#: --trainer choice -> trainer class; each name is also the preset the config starts from.
TRAINERS = {
    "grpo": GRPOTrainer,
    "rloo": RLOOTrainer,
    "reinforce_plus_plus": REINFORCEPlusPlusTrainer,
    "remax": ReMaxTrainer,
}


def make_rows(num: int, seed: int) -> list[dict]:
    """Rows in the verl schema: chat prompt, data_source, reward_model.ground_truth."""
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 4)))
        rows.append(
            {
                "data_source": "reverse_word",
                "prompt": [{"role": "user", "content": f"Reverse: {word}"}],
                "reward_model": {"style": "rule", "ground_truth": word[::-1]},
                "extra_info": {"index": i},
            }
        )
    return rows


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Fraction of the target's characters in the right position (1.0 for an exact answer)."""
    answer = solution_str.strip()
    hits = sum(a == b for a, b in zip(answer, ground_truth, strict=False))
    score = hits / max(len(ground_truth), len(answer), 1)
    # "acc" (optional) is what the acc metrics count; extra keys become reward/extra/* metrics.
    return {"score": score, "acc": float(answer == ground_truth)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 tiny steps (for the tests)")
    parser.add_argument("--trainer", choices=sorted(TRAINERS), default="grpo")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", default="", help="HF model directory (default: a tiny one)")
    parser.add_argument("--out", default="", help="output directory (default: a temp dir)")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="polyrl-example-"))

    model = args.model
    if not model:
        from polyrl.models.tiny import build_tiny_model

        size = "nano" if args.smoke else "micro"
        model = str(build_tiny_model("qwen2", out / f"tiny-{size}", size=size))

    steps = 2 if args.smoke else args.steps
    overrides = [
        f"trainer.output_dir={out / 'run'}",
        f"trainer.total_steps={steps}",
        "trainer.device=cpu",
        "trainer.worker_backend=local",  # engines as local processes, no Ray
        "trainer.loggers=[console,jsonl]",
        "trainer.test_freq=" + str(max(steps // 2, 1)),
        "data.train_batch_size=4" if args.smoke else "data.train_batch_size=16",
        "data.max_prompt_length=32",
        "data.max_response_length=8",
        "actor.ppo_mini_batch_size=0",  # one optimizer step per RL step
        # ReMax samples one response per prompt (plus its greedy baseline); the others need
        # a group of several to compare against.
        "rollout.n=1" if args.trainer == "remax" else "rollout.n=4",
        "rollout.max_new_tokens=8",
        "actor.optim.lr=1e-3",
        *args.set,
    ]
    config = load_config(args.trainer, overrides)
    trainer = TRAINERS[args.trainer](
        model=model,
        config=config,
        reward_fn=compute_score,  # any callable; also "file.py:function" or a scorer name
        train_dataset=make_rows(64 if args.smoke else 512, seed=0),
        eval_dataset=make_rows(8 if args.smoke else 64, seed=1),
    )
    summary = trainer.train()
    keys = ("steps", "first_val_acc", "last_val_acc", "hf_model")
    print(args.trainer, {k: summary.get(k) for k in keys})


if __name__ == "__main__":
    main()
