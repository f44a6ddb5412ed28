"""Samples per second of sync, one_step_off and async GRPO when the agent's tools wait.

The regime of agent training with remote tools: a tool-using episode of ``TOOL_CALLS`` (6)
round-trips, each tool call (and the episode's set-up) waiting 0.3-0.5 s without CPU
(``asyncio.sleep``), as a remote sandbox or a web call does; the model's turns are short (at
most 4 new tokens, half the vocabulary ends a turn). Reward ``-len(turn) / 20`` per step
(dense: a tiny model moves it). The environment lives in ``_waiting_env.py``, a
``trainer.imports`` plugin, so a producer process rolls it out too. The demo's nano model
(random init, no KL term: no reference model) runs the same number of GRPO steps (so the same
number of trained samples) in each ``trainer.mode``, each in a fresh child process
(``async.max_staleness=2`` for ``async``; the two asynchronous modes with
``async.producer=process`` unless ``--producer thread``).

Throughput is trained samples over the summed ``timing_s/step`` of the run (set-up excluded,
the first step included: it holds the asynchronous modes' pipeline fill), as in
``async_rl.py``. ``bound_ratio`` is the classic overlap bound from sync's own phase costs,
``(gen + train) / max(gen, train)`` with ``gen = timing_s/gen`` and ``train`` the rest of the
step, as ``async_rl.py`` measures it; with environments that wait, rollouts of consecutive
batches overlap one another too (``async`` keeps up to ``max_staleness + 1`` batches of
episodes in flight: ``<mode>_in_flight`` is the most episodes running at once that the
episodes saw, averaged over a step's, largest step), so ``ratio`` may beat it.
``reward_async`` and ``reward_sync`` are the mean scores of the second half of the steps;
``reward_noise`` is the standard error of sync's per-step scores over those steps (two runs
whose rewards differ by less than about twice that are within noise). The last stdout line is
the JSON result.

    python benchmarks/async_agent.py [--steps 12] [--producer process|thread] [--workdir DIR]
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
from _waiting_env import TOOL_CALLS  # noqa: E402

MODES = ("sync", "one_step_off", "async")


def child(mode: str, workdir: Path, steps: int, prompts: int, n: int, producer: str) -> None:
    """Train ``steps`` GRPO steps in ``mode`` on the waiting environment (a child process)."""
    import dataclasses

    from polyrl.config import load_config
    from polyrl.trainer.rl import RLTrainer

    cfg = load_config(
        "demo",
        [
            f"trainer.output_dir={workdir / mode}",
            f"trainer.mode={mode}",
            "async.max_staleness=2",
            f"async.producer={producer}",
            f"trainer.imports=[{HERE / '_waiting_env.py'}]",
            "agent.enable=true",
            "agent.default_loop=env",
            f"agent.max_turns={TOOL_CALLS}",
            "model.tiny_size=nano",
            f"data.train_batch_size={prompts}",
            f"rollout.n={n}",
            "rollout.max_new_tokens=4",
            "data.max_response_length=160",
            "actor.use_kl_loss=false",
            "data.max_prompt_length=256",
            f"trainer.total_steps={steps}",
            "trainer.loggers=[jsonl]",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.worker_backend=local",
            "reward.num_workers=0",
        ],
    )
    stops = list(range(20, 1024, 2))  # the random model stops early: short turns, all played
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
    parser.add_argument(
        "--producer",
        default="process",
        choices=("thread", "process"),
        help="async.producer of the one_step_off and async runs",
    )
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="polyrl-async-agent-"))
    if args.child:
        child(args.child, workdir, args.steps, args.prompts, args.n, args.producer)
        return
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    result: dict = {"name": "async_agent", "steps": args.steps, "producer": args.producer}
    scores = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--child", mode, "--workdir", str(workdir)]
        cmd += ["--steps", str(args.steps), "--prompts", str(args.prompts), "--n", str(args.n)]
        cmd += ["--producer", args.producer]
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        records = _records(workdir / mode)
        seconds = sum(r["timing_s/step"] for r in records)
        result[f"{mode}_samples_per_s"] = len(records) * args.prompts * args.n / seconds
        scores[mode] = [r["critic/score/mean"] for r in records]
        # How many episodes ran at once (each episode's peak, averaged over a step's; the
        # largest step): about B * n in sync, up to (max_staleness + 1) * B * n in async.
        result[f"{mode}_in_flight"] = max(r.get("env/in_flight/mean", 0.0) for r in records)
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
