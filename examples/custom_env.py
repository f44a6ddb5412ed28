"""A custom Gym-style text environment, trained on with the ``env`` agent loop.

What it shows: an environment is a class with ``reset(seed, **kwargs) -> observation`` and
``step(text) -> (observation, reward, done, info)`` (either may be ``async``), registered by name
with ``@register_env``. A sample picks the ``env`` loop with ``extra_info.agent_name`` (or
``agent.default_loop=env`` for all), its environment with ``extra_info.env_name`` and the reset
arguments with ``extra_info.env_kwargs``. The first observation is appended to the prompt as a
user turn; each later one is appended as the chat template's token delta (mask 0, not trained
on). The trajectory's reward is the sum of the step rewards, and the numbers in the last
``info`` are logged as ``env/<key>/mean`` metrics. (A random tiny model writes turns that
run to ``rollout.max_new_tokens`` without ending, and a turn cut short ends the episode, so the
smoke run shows one turn per episode.)

Run it::

    python examples/custom_env.py --smoke     # 1 training step on a nano model (tests use this)
    python examples/custom_env.py             # 20 steps on a micro model, CPU

At full size: ``--model /models/Qwen2.5-0.5B-Instruct --steps 200 --set trainer.device=cuda``.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from polyrl import GRPOTrainer
from polyrl.agent import Env, register_env
from polyrl.config import load_config


@register_env("echo_word")
class EchoWordEnv(Env):
    """Says a word; the model must repeat it. Up to ``tries`` turns; reward 1 on a match."""

    def reset(self, seed=None, **kwargs) -> str:
        rng = random.Random(seed)
        self.word = kwargs.get("word") or rng.choice(["apple", "river", "stone", "cloud"])
        self.tries_left = int(kwargs.get("tries", 2))
        return f"Repeat this word exactly: {self.word}"

    def step(self, action: str):
        self.tries_left -= 1
        if action.strip().lower() == self.word:
            return "Correct.", 1.0, True, {"solved": 1.0}
        done = self.tries_left <= 0
        return f"No, the word was {self.word}. Again:", 0.0, done, {"solved": 0.0}


def make_rows(num: int) -> list[dict]:
    return [
        {
            "data_source": "echo_word",
            # The environment's first observation follows this prompt as a user turn.
            "prompt": [{"role": "system", "content": "Answer with one word."}],
            "reward_model": {"ground_truth": ""},
            "extra_info": {
                "agent_name": "env",
                "env_name": "echo_word",
                "env_kwargs": {"tries": 2},
                "index": i,
            },
        }
        for i in range(num)
    ]


def no_score(response):
    """Every sample is still scored, but an env trajectory's own reward replaces this score."""
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="1 tiny step (for the tests)")
    parser.add_argument("--steps", type=int, default=20)
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

    steps = 1 if args.smoke else args.steps
    config = load_config(
        "grpo",
        [
            f"trainer.output_dir={out / 'run'}",
            f"trainer.total_steps={steps}",
            "trainer.device=cpu",
            "trainer.worker_backend=local",
            "trainer.test_freq=0",
            "agent.enable=true",
            "agent.max_turns=2",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=0",
            "data.max_prompt_length=64",
            "data.max_response_length=48",
            "rollout.n=4",
            "rollout.max_new_tokens=8",
            *args.set,
        ],
    )
    trainer = GRPOTrainer(
        model=model, config=config, reward_fn=no_score, train_dataset=make_rows(32)
    )
    summary = trainer.train()
    print({k: summary.get(k) for k in ("steps", "last_score", "metrics")})


if __name__ == "__main__":
    main()
