"""GRPO on the demo's task with a tensor- or sequence-parallel actor, against world size 1.

The demo's job (``polyrl/demo.py``, preset ``demo``): a nano Qwen2 warmed up on 2-digit addition
by the demo's SFT phase (run once, shared), then GRPO through the real trainer (native rollout
server, reward workers, the actor and reference engines, weights pushed every step) three
times from that same checkpoint:

* ``ws1``: one rank (the baseline);
* ``tp2``: two gloo ranks, ``actor.tensor_parallel_size=2`` (one tensor-parallel group);
* ``sp2``: two gloo ranks, ``actor.ulysses_sequence_parallel_size=2``.

The reference engine takes the actor's mesh.  Per run: the mean training reward
(``critic/score/mean``) of the first and the last ``--window`` steps and its gain, and the greedy
accuracy on the 128 held-out prompts before the first and after the last step (the trainer's
validation).  ``ratio`` is the smaller of the tp2 and sp2 reward gains over the ws1 gain: 1
means the parallel runs learn as the single-rank one does (they differ from it only by the
order of floating-point reductions); the goal is every gain > 0 and ``ratio >= 0.8``.

The last stdout line is the JSON result, also appended to
``benchmarks/history/parallel_grpo.jsonl`` (see ``benchmarks/_report.py``).

Usage: ``python benchmarks/parallel_grpo.py [--rl-steps 100] [--window 10] [--out DIR]
[--concurrent]`` (``--concurrent``: the three runs at once, one process each, for a machine
whose cores other jobs share; their seconds are then not comparable).
(``--out`` keeps the runs and reuses a finished warm-up there; ``--sft-model`` starts from an
earlier ``python -m polyrl.demo`` run's ``sft/hf_model`` instead of training the warm-up.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: name -> (ranks, overrides of the actor's mesh)
MODES: dict[str, tuple[int, list[str]]] = {
    "ws1": (1, []),
    "tp2": (2, ["actor.tensor_parallel_size=2"]),
    "sp2": (2, ["actor.ulysses_sequence_parallel_size=2"]),
}


def _scores(metrics_file: Path) -> list[float]:
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    return [r["critic/score/mean"] for r in records if "critic/score/mean" in r]


def run_mode(
    name: str, args: argparse.Namespace, out: Path, sft_dir: str, files: list[str]
) -> dict:
    """GRPO from the warm-up with mode ``name`` on ``files`` (train, held-out); its figures."""
    from polyrl.config import load_config
    from polyrl.trainer.rl import run_rl

    ranks, mesh = MODES[name]
    cfg = load_config(
        "demo",
        [
            f"trainer.output_dir={out / name}",
            f"model.path={sft_dir}",
            f"trainer.total_steps={args.rl_steps}",
            f"trainer.test_freq={args.rl_steps}",
            "trainer.val_before_train=true",
            "trainer.loggers=[jsonl]",
            "trainer.export_hf=false",
            f"trainer.n_gpus_per_node={ranks}",
            *mesh,
        ],
    )
    data = dataclasses.replace(cfg.data, task="", train_files=files[:1], val_files=files[1:])
    cfg = dataclasses.replace(cfg, data=data)
    start = time.perf_counter()
    summary = run_rl(cfg)
    seconds = time.perf_counter() - start
    scores = _scores(Path(summary["metrics"]))
    first = sum(scores[: args.window]) / args.window
    last = sum(scores[-args.window :]) / args.window
    return {
        f"reward_first_{name}": round(first, 4),
        f"reward_last_{name}": round(last, 4),
        f"reward_gain_{name}": round(last - first, 4),
        f"val_acc_before_{name}": summary["first_val_acc"],
        f"val_acc_after_{name}": summary["last_val_acc"],
        f"seconds_{name}": round(seconds, 1),
    }


def _run_concurrently(args: argparse.Namespace, out: Path, sft_dir: str, files: list[str]) -> dict:
    """Run every mode in its own process at once; return their figures merged."""
    procs = {}
    for name in args.modes:
        print(f"[parallel_grpo] {name}: {args.rl_steps} GRPO steps (own process)", flush=True)
        cmd = [
            sys.executable,
            __file__,
            *("--only", name, "--result", str(out / f"{name}.json"), "--out", str(out)),
            *("--rl-steps", str(args.rl_steps), "--window", str(args.window)),
            *("--sft-model", sft_dir, "--files", *files),
        ]
        log_path = out / f"{name}.log"
        with log_path.open("w") as log:
            procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        # One start-up at a time: several at once on a crowded machine overrun the worker
        # groups' start-up timeout. The trainer prints its run header once engines are up.
        while procs[name].poll() is None and "[rl] model " not in log_path.read_text():
            time.sleep(2)
    figures: dict = {}
    for name, proc in procs.items():
        if proc.wait() != 0:
            raise RuntimeError(f"mode {name} failed: see {out / f'{name}.log'}")
        figures.update(json.loads((out / f"{name}.json").read_text()))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rl-steps", type=int, default=100, help="GRPO steps per run")
    parser.add_argument("--window", type=int, default=10, help="steps averaged at each end")
    parser.add_argument(
        "--sft-steps", type=int, default=0, help="SFT warm-up steps (default: the demo's 1000)"
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument(
        "--sft-model",
        default=None,
        help="a finished demo warm-up's hf_model directory to start from (skips the SFT)",
    )
    parser.add_argument("--out", default="", help="output directory (default: a temporary one)")
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="run the modes at the same time, one process each (on a crowded machine)",
    )
    parser.add_argument("--only", default="", help=argparse.SUPPRESS)
    parser.add_argument("--files", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:  # one mode, in a child process of --concurrent
        figures = run_mode(args.only, args, Path(args.out), args.sft_model, args.files)
        Path(args.result).write_text(json.dumps(figures))
        return
    if "ws1" not in args.modes:
        parser.error("--modes needs ws1: it is the baseline")
    if args.rl_steps < 2 * args.window:
        parser.error("--rl-steps must be at least twice --window")

    try:  # run as a script: its own directory is on sys.path
        from _report import report
    except ImportError:  # imported as benchmarks.parallel_grpo
        from benchmarks._report import report
    from polyrl.config import load_config
    from polyrl.demo import warm_up

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp).resolve()
        # The demo's warm-up (SFT, 1000 steps on one rank), shared by every mode.
        sft = [f"sft.total_steps={args.sft_steps}"] if args.sft_steps else []
        prepared = warm_up(
            load_config("demo", [f"trainer.output_dir={out}", *sft]), sft_model=args.sft_model
        )
        sft_dir = str(prepared.sft["hf_model"])
        files = [*prepared.data.train_files, *prepared.data.val_files]
        result: dict = {"name": "parallel_grpo", "rl_steps": args.rl_steps, "window": args.window}
        if args.concurrent:
            result["concurrent"] = True
            result.update(_run_concurrently(args, out, sft_dir, files))
        for name in [] if args.concurrent else args.modes:
            print(f"[parallel_grpo] {name}: {args.rl_steps} GRPO steps", flush=True)
            result.update(run_mode(name, args, out, sft_dir, files))
    base = result["reward_gain_ws1"]
    others = [result[f"reward_gain_{m}"] for m in args.modes if m != "ws1"]
    result["ratio"] = round(min(others) / base, 4) if others and base > 0 else None
    head = ("name", "ratio")
    report({**{k: result[k] for k in head}, **{k: v for k, v in result.items() if k not in head}})


if __name__ == "__main__":
    main()
