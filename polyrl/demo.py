"""The ``make demo`` job: the longest end-to-end path polyrl has today, on CPU, in about a minute.

It builds a tiny random-init model and its locally trained tokenizer, generates the configured
task as train/test parquet files, tokenizes the test prompts through the chat template, samples
``rollout.n`` answers per prompt, scores them with the reward manager (in its sandboxed process
pool) and prints a summary.  When the RL trainer lands this job becomes RL training.

Run ``python -m polyrl.demo [PRESET] [key=value ...]``; the preset defaults to ``demo``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from polyrl.batch import Batch
from polyrl.config import PolyRLConfig, load_config


def sample_responses(
    model: torch.nn.Module,
    prompts: Batch,
    *,
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    eos_token_id: int,
    pad_token_id: int,
    seed: int,
    micro_batch: int = 16,
) -> Batch:
    """Sample ``n`` responses per prompt with Hugging Face ``generate``.

    Returns the prompts repeated ``n`` times (interleaved, so a prompt's samples are adjacent)
    with a right-padded ``responses`` tensor and its ``response_mask`` added.
    """
    torch.manual_seed(seed)
    expanded = prompts.repeat(n, interleave=True)
    outputs: list[torch.Tensor] = []
    parts = expanded.split(micro_batch)
    for part in tqdm(parts, desc="sampling", unit="batch", leave=False):
        with torch.no_grad():
            generated = model.generate(
                input_ids=part["input_ids"],
                attention_mask=part["attention_mask"],
                do_sample=temperature > 0,
                temperature=max(temperature, 1e-5),
                top_p=top_p,
                top_k=top_k if top_k > 0 else None,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
            )
        outputs.append(generated[:, part["input_ids"].shape[1] :])
    width = max(o.shape[1] for o in outputs)
    responses = torch.cat(
        [torch.nn.functional.pad(o, (0, width - o.shape[1]), value=pad_token_id) for o in outputs]
    )
    expanded["responses"] = responses
    expanded["response_mask"] = response_mask(responses, eos_token_id)
    return expanded


def response_mask(responses: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 for generated tokens up to and including the first eos, 0 after it (padding)."""
    is_eos = (responses == eos_token_id).long()
    # Positions strictly after the first eos have a cumulative eos count >= 1 before them.
    after_eos = (is_eos.cumsum(dim=1) - is_eos) > 0
    return (~after_eos).long()


def run(cfg: PolyRLConfig) -> dict[str, Any]:
    """Run the demo job for ``cfg`` and return its summary (also written as JSON)."""
    from polyrl.data.dataset import RLDataset, collate_prompts
    from polyrl.data.tasks import write_task_splits
    from polyrl.models.loader import load_causal_lm, load_tokenizer
    from polyrl.models.tiny import build_tiny_model, count_parameters
    from polyrl.reward.manager import RewardManager

    start = time.perf_counter()
    out_dir = Path(cfg.trainer.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seed = cfg.seed

    if cfg.model.path:
        model_dir = Path(cfg.model.path)
    else:
        model_dir = build_tiny_model(
            cfg.model.tiny_arch, out_dir / "model", size=cfg.model.tiny_size, seed=seed
        )
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, dtype=cfg.model.dtype).eval()
    print(f"[demo] model {model_dir} ({count_parameters(model):,} parameters)")

    if cfg.data.val_files:
        test_files = list(cfg.data.val_files)
    else:
        data_dir = Path(cfg.data.data_dir) if cfg.data.data_dir else out_dir / "data"
        _, test_path = write_task_splits(
            cfg.data.task, data_dir, cfg.data.num_train, cfg.data.num_val, seed=cfg.seed_for("data")
        )
        test_files = [str(test_path)]
    dataset = RLDataset(
        test_files,
        tokenizer,
        max_prompt_length=cfg.data.max_prompt_length,
        truncation=cfg.data.truncation,
    )
    num_prompts = min(len(dataset), cfg.data.val_batch_size)
    prompts = collate_prompts([dataset[i] for i in range(num_prompts)], tokenizer.pad_token_id)
    print(f"[demo] {num_prompts} prompts from {test_files[0]} (task {cfg.data.task or 'files'})")

    samples = sample_responses(
        model,
        prompts,
        n=cfg.rollout.n,
        max_new_tokens=min(cfg.rollout.max_new_tokens, cfg.data.max_response_length),
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        seed=cfg.seed_for("rollout"),
    )
    texts = [
        tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
        for ids, mask in zip(samples["responses"], samples["response_mask"], strict=True)
    ]
    samples["response_text"] = texts

    with RewardManager(
        custom_function=cfg.reward.custom_function or None,
        num_workers=cfg.reward.num_workers,
        timeout_s=cfg.reward.timeout_s,
        error_reward=cfg.reward.error_reward,
    ) as manager:
        result = manager.score(samples)

    scores = result.scores.view(num_prompts, cfg.rollout.n)
    summary = {
        "prompts": num_prompts,
        "samples_per_prompt": cfg.rollout.n,
        "score_mean": float(scores.mean()),
        "pass_at_n": float((scores.max(dim=1).values > 0).float().mean()),
        "response_length_mean": float(samples["response_mask"].sum(dim=1).float().mean()),
        "reward_errors": float(result.metrics.get("reward/errors", 0.0)),
        "elapsed_s": round(time.perf_counter() - start, 2),
    }
    print("[demo] a few samples (ground truth | response | score):")
    ground_truth = samples["ground_truth"]
    for i in range(0, min(len(samples), 4 * cfg.rollout.n), cfg.rollout.n):
        print(f"    {str(ground_truth[i]):>12} | {texts[i]!r:<30} | {float(result.scores[i]):.1f}")
    print("[demo] summary: " + " ".join(f"{k}={v:.3g}" for k, v in summary.items()))
    (out_dir / "demo_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: ``python -m polyrl.demo [PRESET] [key=value ...]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    preset = "demo"
    if args and "=" not in args[0]:
        preset = args.pop(0)
    run(load_config(preset, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
