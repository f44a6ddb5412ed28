"""On-policy distillation of a weak tiny student from the demo's SFT teacher (arithmetic, CPU).

The teacher is the demo's warm-up: the demo's tiny random-init model after its 1000 SFT steps
on 2-digit addition. The student is the same initial model after fewer SFT steps
(``--student-sft-steps``): the same tokenizer, a weaker model. The student is then trained by
pure on-policy distillation (``polyrl train opd``'s options on the demo's config): it samples,
the teacher scores each sampled token, and the per-token reverse KL is the only signal -- the
task reward is a constant 0 here (:func:`zero_reward`), so GRPO's outcome advantage is 0 and
any accuracy the student gains comes from the teacher.

Measured before and after, on the 128 held-out prompts, through native rollout servers:

* the per-token reverse KL to the teacher: the student samples ``--n`` answers per prompt
  (temperature 1); both models score them (prompt log-probs); the figure is the mean over
  response tokens of ``logp_student - logp_teacher``, the single-sample estimate of
  ``KL(student || teacher)`` per token;
* greedy accuracy (the demo's evaluation).

The last stdout line is the JSON result (``benchmarks/_report.py``); ``ratio`` is the reverse
KL before over after (the acceptance asks >= 2) and ``accuracy_gain`` the greedy accuracy after
minus before.

    python benchmarks/opd.py [--steps 100] [--teacher-source server|engine] [--topk 0]
        [--student-sft-steps 500 | --student DIR] [--teacher DIR] [--workdir DIR] [key=value ...]

``--teacher`` / ``--student`` take exported checkpoints of the demo's model (e.g. a finished
``make demo``'s ``outputs/demo/rl/hf_model`` and ``outputs/demo/sft/hf_model``) instead of
running the SFT warm-ups here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _report import report  # noqa: E402


def zero_reward(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None):
    """The task reward of pure distillation: 0 for every answer (the teacher is the signal)."""
    return 0.0


def sft(cfg: Any, model: str, train: Path, out: Path, steps: int) -> str:
    """Run (or reuse) ``steps`` of the demo's SFT from ``model``; return the exported model."""
    from polyrl.trainer.sft import run_sft

    done = out / "hf_model"
    if (done / "config.json").is_file() and (out / "steps.txt").read_text() == str(steps):
        return str(done)
    sft_cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=model),
        data=dataclasses.replace(cfg.data, task="", train_files=[str(train)], val_files=[]),
        trainer=dataclasses.replace(
            cfg.trainer, output_dir=str(out), save_freq=0, loggers=["jsonl"]
        ),
        sft=dataclasses.replace(cfg.sft, export_hf=True, total_steps=steps),
    )
    path = str(run_sft(sft_cfg)["hf_model"])
    (out / "steps.txt").write_text(str(steps))
    return path


async def reverse_kl(
    student_url: str, teacher_url: str, prompts: list[list[int]], n: int, max_new: int, seed: int
) -> float:
    """Mean over the student's sampled response tokens of ``logp_student - logp_teacher``."""
    from polyrl.rollout.client import RolloutClient

    sample = {"n": n, "temperature": 1.0, "max_new_tokens": max_new, "seed": seed}
    score = {"max_new_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    # A busy machine can be slow to accept connections: wait for them rather than fail.
    opts = {"max_concurrency": 32, "connect_timeout": 120.0}
    async with (
        RolloutClient([student_url], **opts) as student,
        RolloutClient([teacher_url], **opts) as teacher,
    ):
        results = await student.generate_many(prompts, sample)
        rows = [(p, o.output_ids) for p, r in zip(prompts, results, strict=True) for o in r.outputs]
        rows = [(p, ids) for p, ids in rows if ids]
        full = [p + ids for p, ids in rows]
        mine, theirs = await asyncio.gather(
            student.generate_many(full, score), teacher.generate_many(full, score)
        )
    ks = []
    for (p, ids), s, t in zip(rows, mine, theirs, strict=True):
        first = len(p)  # the response's tokens, each scored given everything before it
        for j in range(first, first + len(ids)):
            ks.append(s.prompt_logprobs[j] - t.prompt_logprobs[j])
    return statistics.fmean(ks)


def measure(
    cfg: Any, student: str, teacher_url: str, dataset: Any, tok: Any, manager: Any, n: int
) -> dict[str, float]:
    """Greedy held-out accuracy of ``student`` and its per-token reverse KL to the teacher."""
    from polyrl.demo import evaluate
    from polyrl.rollout.launcher import ServerProcess

    prompts = [dataset[i]["input_ids"].tolist() for i in range(len(dataset))]
    with ServerProcess(student, backend="native", options={"dtype": "float32"}) as server:
        url = str(server.url)
        acc = evaluate(url, dataset, tok, cfg, manager)["mean"]
        kl = asyncio.run(
            reverse_kl(url, teacher_url, prompts, n, cfg.rollout.max_new_tokens, cfg.seed)
        )
    return {"accuracy": acc, "reverse_kl": kl}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="distillation steps")
    parser.add_argument("--teacher-source", choices=("server", "engine"), default="server")
    parser.add_argument("--topk", type=int, default=0, help="algorithm.teacher_topk")
    parser.add_argument("--student-sft-steps", type=int, default=500)
    parser.add_argument("--teacher", help="an exported teacher to use instead of the SFT one")
    parser.add_argument("--student", help="an exported student to use instead of the SFT one")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt for the KL")
    parser.add_argument("--workdir", type=Path, default=Path("outputs/bench_opd"))
    parser.add_argument("overrides", nargs="*", help="key=value options of the OPD run")
    args = parser.parse_args()

    from polyrl.config import load_config
    from polyrl.data.dataset import RLDataset
    from polyrl.data.tasks import write_task_splits
    from polyrl.demo import evaluate
    from polyrl.models.loader import load_tokenizer
    from polyrl.models.tiny import build_tiny_model
    from polyrl.reward.manager import RewardManager
    from polyrl.rollout.launcher import ServerProcess
    from polyrl.trainer.rl import run_rl
    from polyrl.trainer.tracking import METRICS_FILE

    start = time.perf_counter()
    work = args.workdir.resolve()
    cfg = load_config("demo", [f"trainer.output_dir={work}"])
    model = build_tiny_model(
        cfg.model.tiny_arch, work / "model", size=cfg.model.tiny_size, seed=cfg.seed
    )
    train, test = write_task_splits(
        cfg.data.task,
        work / "data",
        cfg.data.num_train,
        cfg.data.num_val,
        seed=cfg.seed_for("data"),
        **cfg.data.task_options,
    )
    teacher = args.teacher or sft(cfg, str(model), train, work / "teacher", cfg.sft.total_steps)
    student = args.student or sft(cfg, str(model), train, work / "student", args.student_sft_steps)
    tok = load_tokenizer(teacher)
    dataset = RLDataset([str(test)], tok, cfg.data.max_prompt_length)

    opd = load_config(
        "demo",
        [
            f"trainer.output_dir={work / f'opd_{args.teacher_source}_k{args.topk}'}",
            f"model.path={student}",
            f"data.train_files=[{train}]",
            f"data.val_files=[{test}]",
            "data.task=",
            f"trainer.total_steps={args.steps}",
            "trainer.test_freq=0",
            "trainer.export_hf=true",
            "trainer.loggers=[jsonl]",
            "actor.use_kl_loss=false",
            "algorithm.distill_coef=1.0",
            f"algorithm.teacher_model_path={teacher}",
            f"algorithm.teacher_source={args.teacher_source}",
            f"algorithm.teacher_topk={args.topk}",
            f"reward.custom_function={Path(__file__).resolve()}:zero_reward",
            *args.overrides,
        ],
    )
    manager = RewardManager(num_workers=1, timeout_s=cfg.reward.timeout_s)
    with manager, ServerProcess(teacher, backend="native", options={"dtype": "float32"}) as t:
        teacher_acc = evaluate(str(t.url), dataset, tok, cfg, manager)["mean"]
        before = measure(cfg, student, str(t.url), dataset, tok, manager, args.n)
        print(f"[opd] teacher acc {teacher_acc:.3f}; student before {before}", flush=True)
        summary = run_rl(opd)
        after = measure(cfg, summary["hf_model"], str(t.url), dataset, tok, manager, args.n)
        print(f"[opd] student after {after}", flush=True)
    records = [json.loads(line) for line in (Path(opd.trainer.output_dir) / METRICS_FILE).open()]
    curve = [r["opd/reverse_kl"] for r in records if "opd/reverse_kl" in r]
    report(
        {
            "name": "opd",
            "steps": args.steps,
            "teacher_source": args.teacher_source,
            "topk": args.topk,
            "teacher": args.teacher or f"demo SFT ({cfg.sft.total_steps} steps)",
            "student": args.student or f"demo SFT ({args.student_sft_steps} steps)",
            "teacher_accuracy": round(teacher_acc, 4),
            "accuracy_before": round(before["accuracy"], 4),
            "accuracy_after": round(after["accuracy"], 4),
            "accuracy_gain": round(after["accuracy"] - before["accuracy"], 4),
            "reverse_kl_before": round(before["reverse_kl"], 4),
            "reverse_kl_after": round(after["reverse_kl"], 4),
            "train_reverse_kl_first5": round(statistics.fmean(curve[:5]), 4),
            "train_reverse_kl_last5": round(statistics.fmean(curve[-5:]), 4),
            "seconds": round(time.perf_counter() - start, 1),
            "ratio": round(before["reverse_kl"] / max(after["reverse_kl"], 1e-9), 3),
        }
    )


if __name__ == "__main__":
    main()
