"""The ``make demo`` job: the longest end-to-end path polyrl has today, on CPU, in about a minute.

1. Build a tiny random-init model and its locally trained tokenizer; generate the task as
   train/test parquet files.
2. Serve the model with the native rollout engine (a real HTTP server subprocess), sample
   ``rollout.n`` answers per test prompt token-in/token-out and score them with the reward
   manager (its sandboxed process pool): the accuracy of the untrained model.
3. Warm the model up with the SFT trainer (FSDP2 model engine, loss on answer tokens only).
4. Push the trained weights into the running server (``/update_weights``: the version goes
   up), sample and score again, and print a before/after summary. The learning curves are
   written as a PNG.

When the RL trainer lands this job becomes RL training.

Run ``python -m polyrl.demo [PRESET] [key=value ...]``; the preset defaults to ``demo``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polyrl.config import PolyRLConfig, load_config


async def _sample(
    url: str, prompt_ids: list[list[int]], params: dict[str, Any]
) -> tuple[list[list[int]], int]:
    """Sample through the rollout server; return responses (prompt-major) and weight version."""
    from polyrl.rollout.client import RolloutClient

    async with RolloutClient([url]) as client:
        results = await client.generate_many(prompt_ids, params)
    responses = [list(o.output_ids) for r in results for o in r.outputs]
    return responses, results[0].weight_version


async def _update_weights(url: str, path: str) -> int:
    from polyrl.rollout.client import RolloutClient

    async with RolloutClient([url]) as client:
        return await client.update_weights(path)


def evaluate(
    url: str, dataset: Any, tokenizer: Any, cfg: PolyRLConfig, manager: Any, label: str
) -> dict[str, float]:
    """Sample ``rollout.n`` answers per test prompt from the server and score them."""
    from polyrl.batch import Batch

    num_prompts = min(len(dataset), cfg.data.val_batch_size)
    items = [dataset[i] for i in range(num_prompts)]
    n = cfg.rollout.n
    params = {
        "n": n,
        "temperature": cfg.rollout.temperature,
        "top_p": cfg.rollout.top_p,
        "top_k": cfg.rollout.top_k,
        "max_new_tokens": min(cfg.rollout.max_new_tokens, cfg.data.max_response_length),
        "seed": cfg.seed_for("rollout"),
    }
    responses, version = asyncio.run(
        _sample(url, [item["input_ids"].tolist() for item in items], params)
    )
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses]
    ground_truth = [items[i // n]["reward_model"]["ground_truth"] for i in range(len(texts))]
    batch = Batch(
        non_tensors={
            "data_source": [items[i // n]["data_source"] for i in range(len(texts))],
            "ground_truth": ground_truth,
            "extra_info": [items[i // n].get("extra_info", {}) for i in range(len(texts))],
            "response_text": texts,
        }
    )
    scores = manager.score(batch).scores.view(num_prompts, n)
    print(f"[demo] {label}: weight version {version}; a few samples (ground truth | response):")
    for i in range(0, min(len(texts), 4 * n), n):
        print(f"    {str(ground_truth[i]):>10} | {texts[i]!r}")
    return {
        "score_mean": float(scores.mean()),
        "pass_at_n": float((scores.max(dim=1).values > 0).float().mean()),
        "response_length_mean": sum(len(r) for r in responses) / len(responses),
        "weight_version": version,
    }


def run(cfg: PolyRLConfig) -> dict[str, Any]:
    """Run the demo job for ``cfg`` and return its summary (also written as JSON)."""
    from polyrl.data.dataset import RLDataset
    from polyrl.data.tasks import write_task_splits
    from polyrl.models.loader import load_tokenizer
    from polyrl.models.tiny import build_tiny_model
    from polyrl.reward.manager import RewardManager
    from polyrl.rollout.launcher import ServerProcess
    from polyrl.trainer.sft import run_sft

    start = time.perf_counter()
    out_dir = Path(cfg.trainer.output_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = Path(cfg.model.path) if cfg.model.path else build_tiny_model(
        cfg.model.tiny_arch, out_dir / "model", size=cfg.model.tiny_size, seed=cfg.seed
    )
    data_dir = Path(cfg.data.data_dir) if cfg.data.data_dir else out_dir / "data"
    train_path, test_path = write_task_splits(
        cfg.data.task, data_dir, cfg.data.num_train, cfg.data.num_val, seed=cfg.seed_for("data")
    )
    tokenizer = load_tokenizer(model_dir)
    dataset = RLDataset(
        [str(test_path)], tokenizer, cfg.data.max_prompt_length, truncation=cfg.data.truncation
    )
    # The SFT phase reads the same files and starts from the same initial weights.
    sft_cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=str(model_dir)),
        data=dataclasses.replace(
            cfg.data, task="", train_files=[str(train_path)], val_files=[str(test_path)]
        ),
    )

    manager = RewardManager(
        custom_function=cfg.reward.custom_function or None,
        num_workers=cfg.reward.num_workers,
        timeout_s=cfg.reward.timeout_s,
        error_reward=cfg.reward.error_reward,
    )
    server = ServerProcess(model_dir, backend="native", options={"dtype": cfg.model.dtype})
    with manager, server:
        print(f"[demo] rollout server {server.url} serving {model_dir}")
        before = evaluate(server.url, dataset, tokenizer, cfg, manager, "before training")
        sft_summary = run_sft(sft_cfg)
        version = asyncio.run(_update_weights(server.url, str(sft_summary["hf_model"])))
        print(f"[demo] pushed the trained weights to the server: version {version}")
        after = evaluate(server.url, dataset, tokenizer, cfg, manager, "after training")

    summary = {
        "task": cfg.data.task,
        "prompts": min(len(dataset), cfg.data.val_batch_size),
        "samples_per_prompt": cfg.rollout.n,
        "before": before,
        "after": after,
        "sft_steps": sft_summary.get("steps"),
        "val_loss_first": sft_summary.get("first_val_loss"),
        "val_loss_last": sft_summary.get("last_val_loss"),
        "plot": str(sft_summary.get("plot")),
        "elapsed_s": round(time.perf_counter() - start, 2),
    }
    print(
        f"[demo] summary: task={summary['task']} "
        f"score {before['score_mean']:.3f} -> {after['score_mean']:.3f}, "
        f"pass@{cfg.rollout.n} {before['pass_at_n']:.3f} -> {after['pass_at_n']:.3f}, "
        f"val loss {summary['val_loss_first']:.3f} -> {summary['val_loss_last']:.3f}, "
        f"weight version {before['weight_version']} -> {after['weight_version']}, "
        f"{summary['elapsed_s']:.1f} s; curves in {summary['plot']}"
    )
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
