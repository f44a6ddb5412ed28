"""Samples per second of sync, one_step_off and async GRPO when the environment waits.

A multi-turn task whose environment takes wall time without CPU, as a remote sandbox or a web
call does: ``reset`` and each ``step`` sleep 0.2-0.5 s (``asyncio.sleep``), two model turns per
episode, reward ``-len(turn) / 20`` per step (dense: a tiny model moves it). The demo's nano
model runs the same number of GRPO steps (so the same number of trained samples) in each
``trainer.mode``, each in a fresh child process (``async.max_staleness=2`` for ``async``).

Throughput is trained samples over the summed ``timing_s/step`` of the run (set-up excluded,
the first step included: it holds the asynchronous modes' pipeline fill), as in
``async_rl.py``. ``bound_ratio`` is the classic overlap bound from sync's own phase costs,
``(gen + train) / max(gen, train)`` with ``gen = timing_s/gen`` and ``train`` the rest of the
step, as ``async_rl.py`` measures it; with environments that wait, rollouts of consecutive
batches can overlap one another too, so ``ratio`` may beat it. ``reward_async`` and
``reward_sync`` are the mean scores of the second half of the steps; ``reward_noise`` is the
standard error of sync's per-step scores over those steps (two runs whose rewards differ by
less than about twice that are within noise). The last stdout line is the JSON result.

    python benchmarks/async_agent.py [--steps 12] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _report import report  # noqa: E402

MODES = ("sync", "one_step_off", "async")
SLEEP_S = (0.2, 0.5)


def child(mode: str, workdir: Path, steps: int, prompts: int, n: int) -> None:
    """Train ``steps`` GRPO steps in ``mode`` on the waiting environment (a child process)."""
    import asyncio
    import dataclasses
    import random

    from polyrl.agent import env_loop
    from polyrl.agent.envs import Env, register_env
    from polyrl.config import load_config
    from polyrl.trainer.rl import RLTrainer

    @register_env("bench_waiting_tool")
    class WaitingTool(Env):
        """Two turns; reset and every step wait 0.2-0.5 s without using the CPU."""

        async def reset(self, seed=None, **kwargs):
            self.rng, self.turns = random.Random(seed), 0
            await asyncio.sleep(self.rng.uniform(*SLEEP_S))
            return "Say something short."

        async def step(self, action):
            self.turns += 1
            await asyncio.sleep(self.rng.uniform(*SLEEP_S))
            return "The tool answered. Again.", -len(action) / 20.0, self.turns >= 2, {}

    original = env_loop.EnvAgentLoop.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "env": "bench_waiting_tool"})

    env_loop.EnvAgentLoop.__init__ = init  # the demo rows name no environment
    cfg = load_config(
        "demo",
        [
            f"trainer.output_dir={workdir / mode}",
            f"trainer.mode={mode}",
            "async.max_staleness=2",
            "agent.enable=true",
            "agent.default_loop=env",
            "agent.max_turns=2",
            "model.tiny_size=nano",
            f"data.train_batch_size={prompts}",
            f"rollout.n={n}",
            "rollout.max_new_tokens=8",
            "data.max_response_length=96",
            "data.max_prompt_length=256",
            f"trainer.total_steps={steps}",
            "trainer.loggers=[jsonl]",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.worker_backend=local",
            "reward.num_workers=0",
        ],
    )
    stops = list(range(20, 1024, 3))  # the random model's turns end early: both are played
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, stop_token_ids=stops))
    RLTrainer(cfg).fit()


def _records(path: Path) -> list[dict]:
    lines = (path / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "critic/score/mean" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--workdir", default="")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="polyrl-async-agent-"))
    if args.child:
        child(args.child, workdir, args.steps, args.prompts, args.n)
        return
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    result: dict = {"name": "async_agent", "steps": args.steps}
    scores = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--child", mode, "--workdir", str(workdir)]
        cmd += ["--steps", str(args.steps), "--prompts", str(args.prompts), "--n", str(args.n)]
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        records = _records(workdir / mode)
        seconds = sum(r["timing_s/step"] for r in records)
        result[f"{mode}_samples_per_s"] = len(records) * args.prompts * args.n / seconds
        scores[mode] = [r["critic/score/mean"] for r in records]
        if mode == "sync":
            gen = sum(r["timing_s/gen"] for r in records) / len(records)
            train = seconds / len(records) - gen
            result["sync_gen_s"], result["sync_train_s"] = gen, train
            result["bound_ratio"] = (gen + train) / max(gen, train)
    half = len(scores["sync"]) // 2
    tail = {m: s[half:] for m, s in scores.items()}
    mean = {m: sum(s) / len(s) for m, s in tail.items()}
    sync_tail = tail["sync"]
    var = sum((x - mean["sync"]) ** 2 for x in sync_tail) / max(len(sync_tail) - 1, 1)
    result.update(
        {
            "reward_sync": mean["sync"],
            "reward_one_step_off": mean["one_step_off"],
            "reward_async": mean["async"],
            "reward_noise": math.sqrt(var / len(sync_tail)),
            "one_step_off_ratio": result["one_step_off_samples_per_s"]
            / result["sync_samples_per_s"],
            "ratio": result["async_samples_per_s"] / result["sync_samples_per_s"],
        }
    )
    report(result)


if __name__ == "__main__":
    main()
