"""Benchmark: one GRPO step of polyrl vs. TRL's ``GRPOTrainer`` on CPU.

Workload (the same on both sides): the tiny Qwen2 model built from a config
(``build_tiny_model("qwen2", ..., size="micro", seed=0)``, ~2.5M parameters, fp32), the
arithmetic task (``polyrl.data.tasks``, ``"12+7="`` prompts) rendered with the tokenizer's chat
template; one step = 16 prompts x 8 sampled completions (temperature 1, no top-k/top-p, up to 64
new tokens, stopping at EOS) -> exact-match rewards -> GRPO advantages -> ONE optimizer update
over all 128 completions, no KL term (no reference model), one pass over the batch.

TRL runs in its own environment (``.venv-trl``, made by ``scripts/setup_trl_venv.sh``; no vLLM
there) as a subprocess, ``benchmarks/_trl_grpo_step.py``, which loads the model directory and the
prompt file written here. polyrl runs in this process through :func:`run_polyrl_step`.

Both sides take one untimed warm-up step, then ``--steps`` timed steps; this repeats for
``--rounds`` rounds, TRL and polyrl alternating, and the medians over all timed steps are kept.
A side's ``tokens_per_s`` is generated completion tokens (EOS included) per second of step time.

Run: ``python benchmarks/rl_step.py [--steps 3] [--rounds 2] [--threads 2] [--trl-only |
--polyrl-only] [--bf16] [--polyrl-override KEY=VALUE ...]``. ``--bf16``: bf16 mixed precision on
both sides (TRL ``bf16=True``, polyrl ``model.compute_dtype=bfloat16``). Overrides are for A/B
runs of polyrl options, e.g. ``actor.share_prefix=true``; ``settings`` reports polyrl's median
generation and update times.
The last stdout line is one JSON object, also appended to ``benchmarks/history/rl_step.jsonl``
(see ``benchmarks/_report.py``): ``{"name": "rl_step", "polyrl_step_s", "trl_step_s",
"polyrl_tokens_per_s", "trl_tokens_per_s", "ratio", "settings": {...}}``; ``ratio`` is
``polyrl_tokens_per_s / trl_tokens_per_s`` and null when a side could not run (the reason goes
to stderr and to ``errors``, and the script exits with status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from polyrl.data.dataset import RLDataset  # noqa: E402
from polyrl.data.tasks import generate  # noqa: E402
from polyrl.models.loader import load_tokenizer  # noqa: E402
from polyrl.models.tiny import build_tiny_model  # noqa: E402

try:  # run as a script: its own directory is on sys.path
    from _report import report
except ImportError:  # imported as benchmarks.rl_step
    from benchmarks._report import report

ROOT = Path(__file__).resolve().parent.parent
TRL_CHILD = Path(__file__).resolve().parent / "_trl_grpo_step.py"
DEFAULT_TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"

PROMPTS_PER_STEP = 16
GENERATIONS = 8
MAX_NEW_TOKENS = 64
MAX_PROMPT_LENGTH = 64


def write_prompts(model_dir: Path, out: Path, num: int, seed: int) -> Path:
    """Write ``num`` arithmetic prompts as JSONL rows ``messages``/``prompt_ids``/``ground_truth``.

    ``prompt_ids`` are what polyrl's :class:`~polyrl.data.dataset.RLDataset` feeds the rollout
    (chat template with the generation prompt, no extra special tokens); the TRL child checks
    that its own rendering gives the same ids.
    """
    rows = generate("arithmetic", num, seed, "train")
    dataset = RLDataset(rows, load_tokenizer(model_dir), max_prompt_length=MAX_PROMPT_LENGTH)
    with out.open("w") as f:
        for i in range(len(dataset)):
            item = dataset[i]
            record = {
                "messages": item["raw_prompt"],
                "prompt_ids": item["input_ids"].tolist(),
                "ground_truth": item["reward_model"]["ground_truth"],
            }
            f.write(json.dumps(record) + "\n")
    return out


def run_polyrl_step(
    model_dir: Path,
    prompts_path: Path,
    steps: int,
    threads: int,
    overrides: list[str] | None = None,
) -> dict:
    """Time ``steps`` GRPO steps of polyrl's RL trainer after one warm-up step.

    Same workload as the TRL child: the prompts of ``prompts_path`` in order, 16 per step,
    8 completions each, up to 64 new tokens at temperature 1, one optimizer update per step,
    no KL, ``threads`` torch threads; ``overrides`` (``key=value``) are applied last.

    Returns:
        ``{"step_s": median seconds per step, "tokens_per_s": median completion tokens per
        second, "steps": [...], "completion_tokens": [...], "gen_s": [...], "update_s": [...]}``
        (the last two: the trainer's ``timing_s/gen`` and ``timing_s/update_actor``).

    The trainer runs at world size 1 with its engine in this process and one native rollout
    server subprocess, as ``polyrl train grpo`` does on one CPU box.
    """
    import time

    from polyrl.config import load_config
    from polyrl.trainer.rl import RLTrainer

    rows = []
    for line in prompts_path.read_text().splitlines():
        record = json.loads(line)
        rows.append(
            {
                "prompt": record["messages"],
                "data_source": "arithmetic",
                "reward_model": {"ground_truth": record["ground_truth"]},
            }
        )
    with tempfile.TemporaryDirectory(prefix="polyrl-rl-step-run-") as out:
        cfg = load_config(
            "grpo",
            [
                f"trainer.output_dir={out}",
                f"trainer.total_steps={steps + 1}",
                "trainer.worker_backend=local",  # world size 1: the engine runs in this process
                "trainer.device=cpu",
                "trainer.test_freq=0",
                "trainer.save_freq=0",
                "trainer.loggers=[jsonl]",
                f"data.train_batch_size={PROMPTS_PER_STEP}",
                "data.shuffle=false",
                f"data.max_prompt_length={MAX_PROMPT_LENGTH}",
                f"data.max_response_length={MAX_NEW_TOKENS}",
                f"rollout.n={GENERATIONS}",
                f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
                "rollout.temperature=1.0",
                "actor.optim.lr=1e-6",
                "actor.ppo_mini_batch_size=0",  # one optimizer update per step
                "actor.ppo_epochs=1",
                "actor.use_kl_loss=false",
                "algorithm.use_kl_in_reward=false",
                *(overrides or []),
            ],
        )
        trainer = RLTrainer(cfg, train_rows=rows, model_dir=model_dir)
        times: list[float] = []
        tokens: list[int] = []
        gen_s: list[float] = []
        update_s: list[float] = []
        try:
            trainer.setup()
            for step in range(1, steps + 2):
                tick = time.perf_counter()
                metrics = trainer.step(step)
                elapsed = time.perf_counter() - tick
                if step > 1:  # step 1 is the warm-up
                    times.append(elapsed)
                    tokens.append(int(metrics["perf/response_tokens"]))
                    gen_s.append(float(metrics["timing_s/gen"]))
                    update_s.append(float(metrics["timing_s/update_actor"]))
        finally:
            trainer.close()
    return {
        "step_s": statistics.median(times),
        "tokens_per_s": statistics.median(n / t for n, t in zip(tokens, times, strict=True)),
        "steps": times,
        "completion_tokens": tokens,
        "gen_s": gen_s,
        "update_s": update_s,
    }


def run_trl_step(
    trl_python: Path,
    model_dir: Path,
    prompts_path: Path,
    steps: int,
    threads: int,
    bf16: bool = False,
) -> dict:
    """Run ``_trl_grpo_step.py`` under ``trl_python`` and return its JSON result.

    Raises:
        FileNotFoundError: ``trl_python`` does not exist (``.venv-trl`` not set up).
        RuntimeError: the child failed or printed no JSON result.
    """
    if not trl_python.exists():
        raise FileNotFoundError(
            f"{trl_python} not found: run `bash scripts/setup_trl_venv.sh` to create .venv-trl"
        )
    cmd = [
        str(trl_python),
        str(TRL_CHILD),
        "--model-dir",
        str(model_dir),
        "--prompts",
        str(prompts_path),
        "--steps",
        str(steps),
        "--threads",
        str(threads),
        "--max-new-tokens",
        str(MAX_NEW_TOKENS),
        "--out-dir",
        str(prompts_path.parent / "trl-out"),
        *(["--bf16"] if bf16 else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)  # the child must not pick up this venv's packages
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    sys.stderr.write(proc.stderr[-4000:])
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"TRL child exited with {proc.returncode}; stderr tail:\n{proc.stderr[-2000:]}"
        )
    return json.loads(lines[-1])


def _median_of(runs: list[dict], key: str) -> float | None:
    values = [v for run in runs for v in run[key]]
    return round(statistics.median(values), 3) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round and side")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (medians)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on each side")
    parser.add_argument("--size", default="micro", choices=("nano", "micro"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-python", type=Path, default=DEFAULT_TRL_PYTHON)
    parser.add_argument("--trl-only", action="store_true", help="skip the polyrl side")
    parser.add_argument("--polyrl-only", action="store_true", help="skip the TRL side")
    parser.add_argument(
        "--polyrl-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra polyrl config override (repeatable), e.g. actor.share_prefix=false",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 mixed precision on both sides (TRL bf16=True, polyrl "
        "model.compute_dtype=bfloat16; fp32 master weights on both)",
    )
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1")
    if args.trl_only and args.polyrl_only:
        parser.error("--trl-only and --polyrl-only exclude each other")
    torch.set_num_threads(args.threads)
    overrides = [*(["model.compute_dtype=bfloat16"] if args.bf16 else []), *args.polyrl_override]

    cache = Path(tempfile.gettempdir()) / f"polyrl-bench-qwen2-{args.size}-seed{args.seed}"
    model_dir = build_tiny_model("qwen2", cache, size=args.size, seed=args.seed)
    spec = json.loads((model_dir / "polyrl_tiny_spec.json").read_text())

    polyrl_runs: list[dict] = []
    trl_runs: list[dict] = []
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="polyrl-rl-step-") as tmp:
        prompts = write_prompts(
            model_dir, Path(tmp) / "prompts.jsonl", PROMPTS_PER_STEP * (args.steps + 1), args.seed
        )
        for r in range(args.rounds):
            if not args.polyrl_only and "trl" not in errors:
                try:
                    trl_runs.append(
                        run_trl_step(
                            args.trl_python, model_dir, prompts, args.steps, args.threads, args.bf16
                        )
                    )
                    print(f"round {r}: trl steps {trl_runs[-1]['steps']}", file=sys.stderr)
                except (FileNotFoundError, RuntimeError) as err:
                    errors["trl"] = str(err)
                    print(f"rl_step: TRL side skipped: {err}", file=sys.stderr)
            if not args.trl_only and "polyrl" not in errors:
                try:
                    run = run_polyrl_step(model_dir, prompts, args.steps, args.threads, overrides)
                    polyrl_runs.append(run)
                    print(f"round {r}: polyrl steps {polyrl_runs[-1]['steps']}", file=sys.stderr)
                except RuntimeError as err:
                    errors["polyrl"] = str(err)
                    print(f"rl_step: polyrl side skipped: {err}", file=sys.stderr)

    def medians(runs: list[dict]) -> tuple[float | None, float | None]:
        steps = [s for run in runs for s in run["steps"]]
        tokens = [n for run in runs for n in run["completion_tokens"]]
        if not steps:
            return None, None
        tps = statistics.median(n / s for n, s in zip(tokens, steps, strict=True))
        return round(statistics.median(steps), 3), round(tps, 1)

    polyrl_step_s, polyrl_tps = medians(polyrl_runs)
    trl_step_s, trl_tps = medians(trl_runs)
    ratio = round(polyrl_tps / trl_tps, 2) if polyrl_tps and trl_tps else None
    trl_info = trl_runs[0] if trl_runs else {}
    result = {
        "name": "rl_step",
        "polyrl_step_s": polyrl_step_s,
        "trl_step_s": trl_step_s,
        "polyrl_tokens_per_s": polyrl_tps,
        "trl_tokens_per_s": trl_tps,
        "ratio": ratio,
        "settings": {
            "model": f"qwen2-{args.size}",
            "num_parameters": spec.get("num_parameters"),
            "dtype": "float32",
            "compute_dtype": "bfloat16 (mixed precision)" if args.bf16 else "float32",
            "prompts_per_step": PROMPTS_PER_STEP,
            "generations": GENERATIONS,
            "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": 1.0,
            "updates_per_step": 1,
            "kl": None,
            "task": "arithmetic",
            "steps": args.steps,
            "rounds": args.rounds,
            "threads": args.threads,
            "trl_gen_s": statistics.median(r["gen_s"] for r in trl_runs) if trl_runs else None,
            "polyrl_gen_s": _median_of(polyrl_runs, "gen_s"),
            "polyrl_update_s": _median_of(polyrl_runs, "update_s"),
            "polyrl_overrides": overrides,
            "trl_completion_tokens": [n for r in trl_runs for n in r["completion_tokens"]],
            "polyrl_completion_tokens": [n for r in polyrl_runs for n in r["completion_tokens"]],
            "trl_versions": trl_info.get("versions"),
            "trl_optim": trl_info.get("optim"),
            "trl_loss_type": trl_info.get("loss_type"),
        },
        "errors": errors or None,
    }
    report(result)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
