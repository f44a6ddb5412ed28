"""Chaos: a GRPO run on real Ray losing a random worker every few steps, against one that is not.

Two runs of the demo's GRPO (tiny "nano" Qwen2, CPU, ``trainer.worker_backend=ray``, two rollout
replicas as Ray actors, one reward worker process) with the same seed and settings: an
uninterrupted one, then one in which, every ``--every`` steps (in the step after each save), a
worker drawn at random (seeded; each kind once in every four kills) is killed with SIGKILL, as
the out-of-memory killer or a lost node would:

* ``engine``: rank 0 of the engine group, as the step's actor update starts (the run is rebuilt
  from its newest checkpoint and redoes the steps since);
* ``engine_saving``: the same rank just after the previous step's checkpoint was handed to it,
  while it writes asynchronously (the half-written checkpoint must never be loaded);
* ``replica``: a rollout replica's Ray actor as the step starts (recreated in its slot);
* ``reward``: the reward worker process as the step's scoring starts (its samples scored again).

``trainer.max_restarts`` is large enough for every kill. Figures: ``steps`` completed of
``total_steps``, ``kills`` by kind, ``rebuilds`` (the run loop's ``recovery/restarts``),
``steps_matching`` (steps whose logged metrics, timings aside, equal the uninterrupted run's;
the rollout server's log-prob gap is compared to 1e-6 as it depends on request batching),
``samples_lost`` (samples of the final record that were not trained as in the uninterrupted run:
each missing step's rows, plus every sample scored with the error reward; goal 0),
``elapsed_s`` of both runs and ``lost_s_per_kill`` (their difference over the kills: the time a
recovery costs, restarts, back-off of 0 s and redone steps included). There is no baseline
library: ``ratio`` is ``steps_matching / total_steps`` (goal 1.0).

Not part of ``make test`` (minutes). Run: ``python benchmarks/chaos.py [--steps N] [--every K]``.
The last stdout line is one JSON object (see ``benchmarks/_report.py``) with ``name: "chaos"``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from polyrl.config import load_config  # noqa: E402
from polyrl.controller.worker_group import pid_alive  # noqa: E402
from polyrl.trainer.rl import RLTrainer  # noqa: E402

try:  # run as a script: its own directory is on sys.path
    from _report import report
except ImportError:  # imported as benchmarks.chaos
    from benchmarks._report import report

KINDS = ("engine", "engine_saving", "replica", "reward")
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return -len(solution_str) / 50.0
"""
BATCH, N = 4, 2


def config(out: Path, steps: int, save_freq: int, *extra: str) -> Any:
    """The run's settings (the same for both runs but the output folder)."""
    reward = out.parent / "reward.py"
    reward.write_text(REWARD)
    return load_config(
        "demo",
        [
            f"trainer.output_dir={out}",
            f"reward.custom_function={reward}:compute_score",
            "trainer.worker_backend=ray",
            "trainer.device=cpu",
            "model.tiny_size=nano",
            f"trainer.total_steps={steps}",
            f"trainer.save_freq={save_freq}",
            "trainer.restart_backoff_s=0",
            f"trainer.max_restarts={steps}",
            "trainer.export_hf=false",
            "data.num_train=64",
            f"data.train_batch_size={BATCH}",
            f"rollout.n={N}",
            "rollout.replicas=2",
            "rollout.num_threads=1",
            "rollout.max_new_tokens=8",
            "rollout.max_replica_restarts=100",
            "data.max_response_length=8",
            "trainer.loggers=[jsonl]",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "reward.num_workers=1",
            *extra,
        ],
    )


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


class ChaosTrainer(RLTrainer):
    """Kills one worker (kinds drawn from ``rng``, each once per four kills) in each step after a
    multiple of ``every`` (the saves' steps: so an ``engine_saving`` kill lands while the
    checkpoint is written); a step rerun after a rebuild is not struck again."""

    def __init__(self, cfg: Any, every: int, rng: random.Random) -> None:
        super().__init__(cfg)
        self.every, self.rng = every, rng
        self.kills: list[dict[str, Any]] = []
        self.struck: set[int] = set()
        self.deck: list[str] = []

    def step(self, step: int) -> dict[str, float]:
        if step % self.every == 1 % self.every and step > 1 and step not in self.struck:
            self.struck.add(step)
            if not self.deck:  # each kind once per len(KINDS) kills, in a random order
                self.deck = self.rng.sample(KINDS, len(KINDS))
            kind = self.deck.pop()
            self.kills.append({"step": step, "kind": kind})
            getattr(self, f"_strike_{kind}")()
        return super().step(step)

    def _strike_engine(self) -> None:
        actor, pid = self.actor, self._groups[0].worker_info[0].pid
        update = actor.update_actor

        def killing_update(*args: Any, **kwargs: Any) -> Any:
            actor.update_actor = update
            _kill(pid)
            return update(*args, **kwargs)

        actor.update_actor = killing_update

    def _strike_engine_saving(self) -> None:
        # The previous step saved (save_freq = every) and its write may still be running.
        _kill(self._groups[0].worker_info[0].pid)

    def _strike_replica(self) -> None:
        group = self.servers.group
        _kill(group.worker_info[self.rng.randrange(group.world_size)].pid)

    def _strike_reward(self) -> None:
        rewards = self.producer.rewards
        score = rewards.score

        def killing_score(batch: Any) -> Any:
            rewards.score = score
            for pid in rewards.worker_pids:
                _kill(pid)
            return score(batch)

        rewards.score = killing_score


def comparable(out: Path) -> dict[int, dict[str, Any]]:
    """Each step's record without what depends on time or on the failures."""
    records: dict[int, dict[str, Any]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "critic/score/mean" in r:
            records[r["step"]] = {
                k: v
                for k, v in r.items()
                if not k.startswith(("timing_s/", "perf/", "recovery/", "rollout/replica"))
                and k not in ("time", "rollout/request_retries")
            }
    return records


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    a, b = dict(a), dict(b)
    gap = abs(a.pop("rollout/log_prob_gap", 0.0) - b.pop("rollout/log_prob_gap", 0.0))
    return gap <= 1e-6 and a == b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps of each run")
    parser.add_argument("--every", type=int, default=5, help="kill a worker every K steps")
    parser.add_argument("--save-freq", type=int, default=0, help="0: --every")
    parser.add_argument("--seed", type=int, default=0, help="seeds the choice of victims")
    args = parser.parse_args()
    save_freq = args.save_freq or args.every
    with tempfile.TemporaryDirectory(prefix="polyrl-chaos-") as tmp:
        root = Path(tmp)
        clean = RLTrainer(config(root / "clean", args.steps, save_freq)).fit()
        import ray

        ray.shutdown()  # the chaos run starts its own cluster, as a relaunch would
        chaos_trainer = ChaosTrainer(
            config(root / "chaos", args.steps, save_freq), args.every, random.Random(args.seed)
        )
        chaos = chaos_trainer.fit()
        a, b = comparable(root / "clean"), comparable(root / "chaos")
        lines = (root / "chaos" / "metrics.jsonl").read_text().splitlines()
        records = [r for r in map(json.loads, lines) if "critic/score/mean" in r]
    matching = sum(1 for s in a if s in b and same(a[s], b[s]))
    failed = sum(r.get("reward/errors", 0) + r.get("reward/timeouts", 0) for r in records)
    missing = len(set(a) - set(b))
    kills = chaos_trainer.kills
    by_kind = {k: sum(1 for x in kills if x["kind"] == k) for k in KINDS}
    lost_s = chaos["elapsed_s"] - clean["elapsed_s"]
    report(
        {
            "name": "chaos",
            "total_steps": args.steps,
            "steps": chaos["steps"],
            "kill_every": args.every,
            "save_freq": save_freq,
            "kills": len(kills),
            "kills_by_kind": by_kind,
            "kill_log": kills,
            "rebuilds": int(records[-1].get("recovery/restarts", 0)) if records else 0,
            "steps_matching": matching,
            "samples_lost": int(missing * BATCH * N + failed),
            "elapsed_s": {"uninterrupted": clean["elapsed_s"], "chaos": chaos["elapsed_s"]},
            "lost_s_per_kill": round(lost_s / len(kills), 2) if kills else 0.0,
            "ratio": round(matching / args.steps, 4),
        }
    )


if __name__ == "__main__":
    sys.exit(main())
