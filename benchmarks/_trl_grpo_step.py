"""TRL side of ``benchmarks/rl_step.py``: time GRPO steps of TRL's ``GRPOTrainer`` on CPU.

Runs under ``.venv-trl/bin/python`` (see ``scripts/setup_trl_venv.sh``), never under polyrl's
``.venv``, and imports nothing from polyrl: the parent script builds the tiny model directory and
writes the prompts, this script only loads them from disk.

One step = 16 prompts x 8 completions (up to 64 new tokens, temperature 1, plain
``model.generate``, no vLLM) -> rewards -> group advantages -> ONE optimizer update over all 128
completions (by default per-device batch 128 and gradient accumulation 1; ``--micro-batch M``
makes it 128/M accumulated micro-batches; ``steps_per_generation`` equals the accumulation, so
one generation feeds exactly one update and no completion is reused), ``beta=0`` (no reference
model), ``num_iterations=1``, fp32 (``--bf16``: bf16 mixed precision), no gradient
checkpointing, no logging, no saving.

The reward is the arithmetic task's exact-match scorer reimplemented here (answer after the
last ``####`` or the whole text, last integer compared with the ground truth); it is cheap
(microseconds per completion) and its result does not change the amount of work in a step.

Completion tokens are counted in the reward function, which sees the token ids of every
completion (each one up to and including its EOS token when it stopped early).

Input (``--prompts``): JSONL rows ``{"messages": [...], "prompt_ids": [...], "ground_truth":
"19"}``; the child renders ``messages`` with TRL's own chat-template path and checks that the
ids are the ``prompt_ids`` the parent (polyrl) rendered, so both sides see the same prompts.

Output: progress on stderr; the last stdout line is one JSON object
``{"step_s": median, "tokens_per_s": tokens / step time (median over steps), "steps": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

# Nothing may be fetched at run time; the model and tokenizer come from a local directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch  # noqa: E402

PROMPTS_PER_STEP = 16
GENERATIONS = 8
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def arithmetic_reward(completion: str, ground_truth: str) -> float:
    """Exact match of the last integer after the last ``####`` (whole text when absent)."""
    answer = completion.rsplit("####", 1)[1] if "####" in completion else completion
    numbers = _NUMBER.findall(answer)
    if not numbers:
        return 0.0
    last = numbers[-1].replace(",", "")
    try:
        value = float(last)
    except ValueError:
        return 0.0
    return 1.0 if value.is_integer() and int(value) == int(ground_truth) else 0.0


def load_prompts(path: Path) -> list[dict]:
    """Read the parent's JSONL prompt file; fail loudly on a malformed row."""
    rows = []
    with path.open() as f:
        for i, line in enumerate(f):
            row = json.loads(line)
            missing = {"messages", "prompt_ids", "ground_truth"} - row.keys()
            if missing:
                raise ValueError(f"{path} row {i}: missing keys {sorted(missing)}")
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--prompts", required=True, type=Path, help="JSONL written by rl_step.py")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=PROMPTS_PER_STEP * GENERATIONS)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 mixed precision (GRPOConfig bf16=True: autocast, fp32 master weights)",
    )
    parser.add_argument("--out-dir", type=Path, default=None, help="scratch dir (nothing saved)")
    args = parser.parse_args()
    batch = PROMPTS_PER_STEP * GENERATIONS
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    if args.micro_batch < 1 or batch % args.micro_batch:
        raise SystemExit(f"--micro-batch must divide {batch}, got {args.micro_batch}")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    transformers.logging.set_verbosity_error()
    rows = load_prompts(args.prompts)
    needed = PROMPTS_PER_STEP * (args.steps + 1)
    if len(rows) < needed:
        raise SystemExit(f"{args.prompts} has {len(rows)} prompts, {needed} needed")
    rows = rows[:needed]

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    # Same prompt tokens on both sides: TRL renders the messages itself, the parent used polyrl.
    for i, row in enumerate(rows[:PROMPTS_PER_STEP]):
        ids = tokenizer.apply_chat_template(
            row["messages"], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        if list(ids) != row["prompt_ids"]:
            raise SystemExit(
                f"prompt {i}: TRL's chat-template ids {list(ids)} differ from polyrl's "
                f"{row['prompt_ids']}"
            )

    dataset = Dataset.from_list(
        [{"prompt": r["messages"], "ground_truth": str(r["ground_truth"])} for r in rows]
    )

    step_tokens: list[int] = []
    reward_at: list[float] = []

    def reward_fn(completions, completion_ids, ground_truth, **_):
        reward_at.append(time.perf_counter())
        step_tokens.append(sum(len(c) for c in completion_ids))
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [arithmetic_reward(t, gt) for t, gt in zip(texts, ground_truth, strict=True)]

    class StepClock(TrainerCallback):
        """Timestamps of optimizer-step boundaries (one step = one generation + one update)."""

        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())

    out_dir = args.out_dir or Path(os.environ.get("TMPDIR", "/tmp")) / "polyrl-trl-grpo-step"
    config = GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=args.bf16,  # GRPOConfig defaults to bf16; fp32 unless --bf16 (as polyrl on CPU)
        fp16=False,
        gradient_checkpointing=False,  # GRPOConfig defaults to True; recomputation is not wanted
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=batch // args.micro_batch,
        steps_per_generation=batch // args.micro_batch,  # one generation per optimizer step
        num_generations=GENERATIONS,
        num_iterations=1,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,  # no KL term, so GRPOTrainer builds no reference model
        use_vllm=False,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=args.steps + 1,
        shuffle_dataset=False,
        seed=args.seed,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )
    clock = StepClock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    if trainer.ref_model is not None:
        raise SystemExit("GRPOTrainer built a reference model although beta=0")
    if getattr(trainer.model, "is_gradient_checkpointing", False):
        raise SystemExit("gradient checkpointing is on although it was turned off")
    trainer.train()

    if {len(clock.begin), len(clock.end), len(step_tokens)} != {args.steps + 1}:
        raise SystemExit(
            f"expected {args.steps + 1} optimizer steps and generations, got "
            f"{len(clock.begin)}/{len(clock.end)} step begins/ends and {len(step_tokens)} "
            "generations"
        )
    # Step i (i >= 1) runs from the end of step i-1 to the end of step i: everything the
    # training loop does between two optimizer updates, data loading included. Step 0 is warm-up.
    step_s = [clock.end[i] - clock.end[i - 1] for i in range(1, args.steps + 1)]
    gen_s = [reward_at[i] - clock.begin[i] for i in range(1, args.steps + 1)]
    tokens = step_tokens[1:]
    for i, (s, g, n) in enumerate(zip(step_s, gen_s, tokens, strict=True)):
        print(
            f"trl step {i}: {s:.2f} s (generation {g:.2f} s), {n} completion tokens",
            file=sys.stderr,
        )
    result = {
        "step_s": round(statistics.median(step_s), 3),
        "tokens_per_s": round(
            statistics.median(n / s for n, s in zip(tokens, step_s, strict=True)), 1
        ),
        "gen_s": round(statistics.median(gen_s), 3),
        "steps": [round(s, 3) for s in step_s],
        "completion_tokens": tokens,
        "warmup_s": round(clock.end[0] - clock.begin[0], 3),
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "optim": str(config.optim),
        "loss_type": config.loss_type,
        "scale_rewards": config.scale_rewards,
        "micro_batch": args.micro_batch,
        "threads": args.threads,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
