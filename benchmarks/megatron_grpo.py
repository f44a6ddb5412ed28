"""GRPO on the demo's task with the Megatron-Core backend (TP 1 and TP 2) against FSDP2.

One run: the demo's SFT warm-up once (:func:`async_rl.warm_up`, the same checkpoint every
configuration starts from), then the demo's GRPO (its preset: 32 prompts x 8 answers, the
rule-based arithmetic reward, KL to the SFT model) for ``--steps`` steps in each configuration,
each a fresh ``polyrl train demo`` child process on two CPU ranks (``trainer.n_gpus_per_node=2``,
local workers over gloo):

* ``fsdp2``: the baseline, two data-parallel ranks;
* ``megatron_tp1``: ``actor.engine_backend=megatron``, two data-parallel ranks;
* ``megatron_tp2``: ``actor.megatron.tensor_model_parallel_size=2``, one replica whose two ranks
  must get the same rows from the trainer's dispatch.

Figures per configuration: the training reward (``critic/score/mean``) averaged over the first
and the last 10 steps, held-out greedy accuracy (128 prompts) before the first step and after
the last, and seconds per step. ``ratio`` is the smallest reward gain (last 10 minus first 10
steps) of the Megatron configurations over the FSDP2 gain: about 1 when Megatron learns as
FSDP2 does. Needs megatron-core: run it with ``.venv-megatron/bin/python`` (``make
test-megatron`` builds it).

    .venv-megatron/bin/python benchmarks/megatron_grpo.py [--steps 60] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _report import report  # noqa: E402
from async_rl import warm_up  # noqa: E402

#: The configurations, each on two ranks: name -> extra overrides.
CONFIGS = {
    "fsdp2": (),
    "megatron_tp1": ("actor.engine_backend=megatron",),
    "megatron_tp2": (
        "actor.engine_backend=megatron",
        "actor.megatron.tensor_model_parallel_size=2",
    ),
}
BASELINE = "fsdp2"
WINDOW = 10  # steps averaged at each end of the reward curve


def run_config(name: str, model: str, train: str, test: str, steps: int, out: Path) -> dict:
    """Run the demo's GRPO in configuration ``name`` in a child process; its figures."""
    overrides = [
        f"model.path={model}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        f"trainer.test_freq={steps}",
        "trainer.val_before_train=true",
        "trainer.loggers=[jsonl]",
        "trainer.export_hf=false",
        "trainer.n_gpus_per_node=2",
        *CONFIGS[name],
    ]
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "PYTHONPATH": str(HERE.parent)}
    cmd = [sys.executable, "-m", "polyrl.cli", "train", "demo", *overrides]
    tick = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - tick
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"[megatron_grpo] {name} failed (exit {proc.returncode})")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "critic/score/mean" in r]
    scores = [r["critic/score/mean"] for r in trained]
    window = min(WINDOW, len(scores))
    accuracy = [r["val/acc/mean@1"] for r in records if "val/acc/mean@1" in r]
    return {
        "score_first": sum(scores[:window]) / window,
        "score_last": sum(scores[-window:]) / window,
        "accuracy_before": accuracy[0],
        "accuracy_after": accuracy[-1],
        "step_s": sum(r["timing_s/step"] for r in trained) / len(trained),
        "wall_s": wall,
    }


def main() -> None:
    """Warm up once, run each configuration, record and print the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps of each configuration")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="configurations to run")
    parser.add_argument("--workdir", default=None, help="reuses a warm-up it already holds")
    args = parser.parse_args()
    if importlib.util.find_spec("megatron.core") is None:
        raise SystemExit(
            "[megatron_grpo] needs megatron-core: run it with .venv-megatron/bin/python "
            "(scripts/setup_megatron_venv.sh or make test-megatron creates it)"
        )
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"[megatron_grpo] unknown configurations {unknown}; have {list(CONFIGS)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="polyrl-megatron-grpo-"))
    tick = time.perf_counter()
    model, train, test = warm_up(workdir)
    print(f"[megatron_grpo] SFT warm-up done in {time.perf_counter() - tick:.0f} s", flush=True)
    results = {}
    for name in names:
        results[name] = r = run_config(name, model, train[0], test[0], args.steps, workdir / name)
        print(
            f"[megatron_grpo] {name:13s} score {r['score_first']:.3f} -> {r['score_last']:.3f} "
            f"(first / last {WINDOW} steps), held-out accuracy {r['accuracy_before']:.3f} -> "
            f"{r['accuracy_after']:.3f}, {r['step_s']:.2f} s/step ({r['wall_s']:.0f} s wall)",
            flush=True,
        )
    out: dict = {"name": "megatron_grpo", "steps": args.steps}
    for name, r in results.items():
        for key in ("score_first", "score_last", "accuracy_before", "accuracy_after", "step_s"):
            out[f"{name}_{key}"] = round(r[key], 4)
    gains = {name: r["score_last"] - r["score_first"] for name, r in results.items()}
    megatron = [gains[n] for n in results if n != BASELINE]
    if BASELINE in gains and megatron and gains[BASELINE] > 0:
        out["ratio"] = round(min(megatron) / gains[BASELINE], 3)
    else:
        out["ratio"] = None
    report(out)


if __name__ == "__main__":
    main()
