"""The ``make demo`` job: SFT warm-up, then GRPO, of a tiny model on CPU, in a few minutes.

1. Generate the arithmetic task (train / held-out test splits) and build a tiny random-init
   model with its locally trained tokenizer; nothing is downloaded.
2. Warm the model up with the SFT trainer (a few dozen steps: it learns the answer format and
   some of the sums).
3. Train it with GRPO (:mod:`polyrl.trainer.rl`): a native rollout server samples
   ``rollout.n`` answers per prompt, the reward manager scores them, the actor engine updates and
   pushes its weights back to the server every step.
4. Evaluate the SFT and the RL checkpoints on the held-out split through one rollout server
   (greedy accuracy and mean@k / pass@k of answers sampled at ``rollout.temperature``), print
   a table, and print as the last line
   ``{"name": "demo", "seconds", "sft_accuracy", "rl_accuracy", "plot"}``.

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

from polyrl.config import ConfigError, PolyRLConfig, load_config


async def _sample(
    url: str, items: list[dict[str, Any]], params: dict[str, Any]
) -> tuple[list[list[int]], int]:
    """Sample through the rollout server; return responses (prompt-major) and weight version.

    A vision prompt's images go with it (``multi_modal``); text prompts go as one batch.
    """
    from polyrl.core.columns import MULTI_MODAL
    from polyrl.rollout.client import RolloutClient

    prompt_ids = [item["input_ids"].tolist() for item in items]
    async with RolloutClient([url]) as client:
        if any(item.get(MULTI_MODAL) is not None for item in items):
            results = await asyncio.gather(
                *(
                    client.generate(ids, params, multi_modal=item.get(MULTI_MODAL))
                    for ids, item in zip(prompt_ids, items, strict=True)
                )
            )
        else:
            results = await client.generate_many(prompt_ids, params)
    responses = [list(o.output_ids) for r in results for o in r.outputs]
    return responses, results[0].weight_version


async def _update_weights(url: str, path: str) -> int:
    from polyrl.rollout.client import RolloutClient

    async with RolloutClient([url]) as client:
        return await client.update_weights(path)


def evaluate(
    url: str,
    dataset: Any,
    tokenizer: Any,
    cfg: PolyRLConfig,
    manager: Any,
    n: int = 1,
    temperature: float = 0.0,
) -> dict[str, float]:
    """Accuracy of the served model on every prompt of ``dataset``: mean@n and pass@n."""
    from polyrl.core.batch import Batch

    items = [dataset[i] for i in range(len(dataset))]
    params = {
        "n": n,
        "temperature": temperature,
        "max_new_tokens": min(cfg.rollout.max_new_tokens, cfg.data.max_response_length),
        "seed": cfg.seed_for("rollout"),
    }
    responses, version = asyncio.run(_sample(url, items, params))
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    batch = Batch(
        non_tensors={
            "data_source": [items[i // n]["data_source"] for i in range(len(texts))],
            "ground_truth": [
                items[i // n]["reward_model"]["ground_truth"] for i in range(len(texts))
            ],
            "extra_info": [items[i // n].get("extra_info", {}) for i in range(len(texts))],
            "response_text": texts,
        }
    )
    correct = (manager.score(batch).scores >= 1.0).float().view(len(items), n)
    return {
        "mean": float(correct.mean()),
        "pass": float((correct.max(dim=1).values > 0).float().mean()),
        "weight_version": version,
        "examples": [(items[i]["raw_prompt"], texts[i * n]) for i in range(min(4, len(items)))],
    }


def _table(
    rows: list[tuple[str, dict[str, Any], dict[str, Any]]], k: int, temperature: float
) -> str:
    lines = [
        f"{'checkpoint':<12} {'greedy acc':>10} {f'mean@{k}':>8} {f'pass@{k}':>8}"
        f"   (sampled at temperature {temperature:g})",
        "-" * 41,
    ]
    for name, greedy, sampled in rows:
        lines.append(
            f"{name:<12} {greedy['mean']:>10.3f} {sampled['mean']:>8.3f} {sampled['pass']:>8.3f}"
        )
    return "\n".join(lines)


#: Written beside a finished warm-up: what it was trained with.
SFT_KEY_FILE = "demo_sft_key.json"


def sft_key(cfg: PolyRLConfig) -> dict[str, Any]:
    """Return what the demo's SFT warm-up depends on (model, data, SFT, seed, device)."""
    return json.loads(
        json.dumps(
            {
                "model": dataclasses.asdict(cfg.model),
                "data": dataclasses.asdict(cfg.data),
                "sft": dataclasses.asdict(cfg.sft),
                "seed": cfg.seed,
                "device": cfg.trainer.device,
                "world_size": cfg.trainer.world_size,
                "steps": cfg.sft.total_steps or cfg.trainer.total_steps,
            },
            default=str,
        )
    )


def finished_sft(sft_dir: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """Return the summary of a finished warm-up in ``sft_dir`` trained as ``key`` says, if any.

    Finished: its summary (written last) and its exported model are there, and so is the key
    it was trained with, equal to ``key``. The summary's model path is read relative to
    ``sft_dir``, so a copied warm-up serves too.
    """
    from polyrl.trainer.sft import HF_DIR, SUMMARY_FILE

    try:
        summary = json.loads((sft_dir / SUMMARY_FILE).read_text())
        saved = json.loads((sft_dir / SFT_KEY_FILE).read_text())
    except (OSError, ValueError):
        return None
    hf_dir = sft_dir / HF_DIR
    if saved != key or not (hf_dir / "config.json").is_file():
        return None
    return {**summary, "hf_model": str(hf_dir)}


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """What :func:`warm_up` leaves behind for the GRPO phase.

    Attributes:
        out_dir: the run's output directory (``trainer.output_dir``, resolved).
        model_dir: the initial model (``model.path``, or the tiny model built there).
        test_path: the held-out split.
        data: ``cfg.data`` pointing at the generated train / held-out files.
        sft: the warm-up's summary; ``sft["hf_model"]`` is the warmed-up model directory.
    """

    out_dir: Path
    model_dir: Path
    test_path: Path
    data: Any
    sft: dict[str, Any]


def warm_up(cfg: PolyRLConfig, sft_model: str | None = None) -> WarmUp:
    """Run steps 1-2 of the demo: build the model and task splits, then the SFT warm-up.

    A finished warm-up trained as ``cfg`` says (see :func:`finished_sft`) is reused; with
    ``sft_model`` (a Hugging Face directory of an earlier warm-up) none is trained.
    """
    from polyrl.data.tasks import write_task_splits
    from polyrl.models.tiny import build_tiny_model
    from polyrl.trainer.sft import run_sft

    out_dir = Path(cfg.trainer.output_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = (
        Path(cfg.model.path)
        if cfg.model.path
        else build_tiny_model(
            cfg.model.tiny_arch, out_dir / "model", size=cfg.model.tiny_size, seed=cfg.seed
        )
    )
    data_dir = Path(cfg.data.data_dir) if cfg.data.data_dir else out_dir / "data"
    train_path, test_path = write_task_splits(
        cfg.data.task,
        data_dir,
        cfg.data.num_train,
        cfg.data.num_val,
        seed=cfg.seed_for("data"),
        **cfg.data.task_options,
    )
    files = dataclasses.replace(
        cfg.data, task="", train_files=[str(train_path)], val_files=[str(test_path)]
    )
    key = sft_key(cfg)
    sft_summary = finished_sft(out_dir / "sft", key)
    if sft_model is not None:
        if not (Path(sft_model) / "config.json").is_file():
            raise FileNotFoundError(f"sft_model {sft_model!r} is no Hugging Face model directory")
        print(f"[demo] 1/3 SFT warm-up: using the warmed-up model {sft_model}", flush=True)
        sft_summary = {"hf_model": str(sft_model)}
    elif sft_summary is not None:
        # A finished warm-up of the same length (an earlier run into this directory, or one
        # copied there): the GPU check's GRPO runs share one this way.
        print(f"[demo] 1/3 SFT warm-up: reusing the finished one in {out_dir / 'sft'}", flush=True)
    else:
        print(f"[demo] 1/3 SFT warm-up: {key['steps']} steps on {train_path}", flush=True)
        sft_cfg = dataclasses.replace(
            cfg,
            # The warm-up is where a vision tower learns to see: a freeze the preset asks for
            # (model.freeze_vision_tower) is for the RL phase.
            model=dataclasses.replace(cfg.model, path=str(model_dir), freeze_vision_tower=False),
            data=files,
            trainer=dataclasses.replace(
                cfg.trainer, output_dir=str(out_dir / "sft"), save_freq=0, loggers=["jsonl"]
            ),
            sft=dataclasses.replace(cfg.sft, export_hf=True),
        )
        sft_summary = run_sft(sft_cfg)
        (out_dir / "sft" / SFT_KEY_FILE).write_text(json.dumps(key, indent=2) + "\n")
    return WarmUp(out_dir, Path(model_dir), Path(test_path), files, sft_summary)


def run(cfg: PolyRLConfig) -> dict[str, Any]:
    """Run the demo job for ``cfg`` and return its summary (also written as JSON)."""
    from polyrl.data.dataset import RLDataset
    from polyrl.models.loader import load_tokenizer
    from polyrl.reward.manager import RewardManager
    from polyrl.rollout.launcher import ServerProcess
    from polyrl.trainer.rl import run_rl
    from polyrl.trainer.rl.build import vision_processor

    start = time.perf_counter()
    prepared = warm_up(cfg)
    out_dir, model_dir, test_path = prepared.out_dir, prepared.model_dir, prepared.test_path
    files, sft_summary = prepared.data, prepared.sft
    sft_dir = str(sft_summary["hf_model"])

    print(f"[demo] 2/3 GRPO: {cfg.trainer.total_steps} steps from the SFT checkpoint", flush=True)
    rl_cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, path=sft_dir),
        data=files,
        trainer=dataclasses.replace(cfg.trainer, output_dir=str(out_dir / "rl"), export_hf=True),
    )
    rl_summary = run_rl(rl_cfg)
    rl_dir = str(rl_summary["hf_model"])

    print("[demo] 3/3 evaluating both checkpoints on the held-out split", flush=True)
    tokenizer = load_tokenizer(model_dir)
    dataset = RLDataset(
        [str(test_path)],
        tokenizer,
        cfg.data.max_prompt_length,
        truncation=cfg.data.truncation,
        apply_chat_template_kwargs=cfg.data.apply_chat_template_kwargs,
        processor=vision_processor(cfg, model_dir, tokenizer),
        image_key=cfg.data.image_key,
        video_key=cfg.data.video_key,
    )
    k = max(cfg.rollout.n, 2)
    # Sampled answers at the temperature GRPO sampled at: the policy as the run trained it
    # (the VLM demo samples at 0.5; at 1 its flatter distribution answers with stray tokens).
    sample_temperature = cfg.rollout.temperature or 1.0
    manager = RewardManager(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
    server = ServerProcess(sft_dir, backend="native", options={"dtype": cfg.model.dtype})
    rows = []
    with manager, server:
        for name, path in (("sft", None), ("sft+grpo", rl_dir)):
            if path is not None:
                asyncio.run(_update_weights(str(server.url), path))
            greedy = evaluate(str(server.url), dataset, tokenizer, cfg, manager)
            sampled = evaluate(
                str(server.url),
                dataset,
                tokenizer,
                cfg,
                manager,
                n=k,
                temperature=sample_temperature,
            )
            rows.append((name, greedy, sampled))
    print(f"[demo] held-out accuracy ({len(dataset)} {cfg.data.task} prompts):")
    print(_table(rows, k, sample_temperature))
    print("[demo] a few greedy answers after RL (prompt -> answer):")
    for prompt, answer in rows[1][1]["examples"]:
        text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        print(f"    {text!r} -> {answer!r}")
    seconds = round(time.perf_counter() - start, 1)
    plot = rl_summary.get("plot")
    summary = {
        # "demo" for the text demo; the VLM demo's preset names its own (demo_vlm).
        "name": cfg.trainer.experiment_name or "demo",
        "seconds": seconds,
        "sft_accuracy": round(rows[0][1]["mean"], 4),
        "rl_accuracy": round(rows[1][1]["mean"], 4),
        # The policy's own answers (at rollout.temperature, mean over k samples per prompt).
        "sft_sampled_accuracy": round(rows[0][2]["mean"], 4),
        "rl_sampled_accuracy": round(rows[1][2]["mean"], 4),
        "plot": plot,
    }
    detail = {
        **summary,
        "sft_mean_at_k": rows[0][2]["mean"],
        "rl_mean_at_k": rows[1][2]["mean"],
        "k": k,
        "sample_temperature": sample_temperature,
        "sft_steps": sft_summary.get("steps"),
        "rl_steps": rl_summary.get("steps"),
        "sft_plot": sft_summary.get("plot"),
    }
    (out_dir / "demo_summary.json").write_text(json.dumps(detail, indent=2) + "\n")
    print(f"[demo] learning curves: {plot}")
    print(json.dumps(summary))
    return summary


_USAGE = """usage: python -m polyrl.demo [PRESET] [key=value ...]

Run a demo preset (default: demo; demo_vlm for the vision-language one): an SFT warm-up, then
GRPO, then one JSON line with held-out accuracy after each."""


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: ``python -m polyrl.demo [PRESET] [key=value ...]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0
    preset = "demo"
    if args and "=" not in args[0]:
        preset = args.pop(0)
    try:
        cfg = load_config(preset, args)
    except ConfigError as exc:
        # Bad input: one line naming it and what was expected, as the polyrl CLI does.
        print(f"polyrl.demo: error: {exc}", file=sys.stderr)
        return 2
    run(cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
