"""The RL step over the transfer queue: row packing, and equal metrics with and without it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from test_rl_trainer import _e2e_overrides
from test_transfer_queue import _prompt_media

from polyrl.config import ConfigError, load_config
from polyrl.core.batch import Batch
from polyrl.core.columns import MULTI_MODAL
from polyrl.core.rollout_batch import build_rollout_batch
from polyrl.model_engine.engine import TEMPERATURE_KEY
from polyrl.trainer.rl import RLTrainer
from polyrl.trainer.rl.generation import at_sampling_temperature
from polyrl.trainer.rl.store_worker import merge_rollout_summaries, sample_rows
from polyrl.transfer import make_transfer_queue
from polyrl.transfer._core import value_nbytes
from polyrl.workers.store import StepLayout, StoreClient, StoredRows


def _random_rollout(rng: random.Random, rows: int, with_masks: bool):
    prompts = [[rng.randrange(3, 50) for _ in range(rng.randint(1, 7))] for _ in range(rows)]
    responses = [[rng.randrange(3, 50) for _ in range(rng.randint(0, 6))] for _ in range(rows)]
    logps = [[-rng.random() for _ in r] for r in responses]
    masks = [[rng.choice([0, 1]) for _ in r] for r in responses] if with_masks else None
    return prompts, responses, logps, masks


@pytest.mark.parametrize("with_masks", [False, True])
def test_rows_through_the_queue_rebuild_the_driver_batch_exactly(with_masks):
    rng = random.Random(3)
    prompts, responses, logps, masks = _random_rollout(rng, 12, with_masks)
    whole = build_rollout_batch(prompts, responses, 0, logps, masks)
    whole.non_tensors["uid"] = [f"u{i // 3}" for i in range(12)]
    scores = torch.arange(12, dtype=torch.float32)
    queue = make_transfer_queue("local")
    # Two producers, each packing its own share with its own (narrower) widths.
    for lo, hi in ((0, 5), (5, 12)):
        part = build_rollout_batch(
            prompts[lo:hi], responses[lo:hi], 0, logps[lo:hi], masks[lo:hi] if masks else None
        )
        part.non_tensors["uid"] = whole.non_tensors["uid"][lo:hi]
        part["score"] = scores[lo:hi]
        part["acc"] = (scores[lo:hi] > 4).float()
        rows = sample_rows(part)
        queue.put(rows, "step-1", sample_ids=list(range(lo, hi)))
    meta = queue.get_meta(["prompt_ids", "score"], 12, "step-1", consumer="trainer")
    width_p = max(len(p) for p in prompts)
    width_r = max(len(r) for r in responses)
    layout = StepLayout(width_p, width_r, pad_id=0)
    # The step tags its rows with the rollout's temperature (the driver's batch in its meta).
    stored = at_sampling_temperature(StoredRows(meta, layout, ("score", "uid")), 0.7)
    whole = at_sampling_temperature(whole, 0.7)
    # Every data-parallel shard rebuilds exactly the driver batch's rows.
    shards = stored.__dp_chunks__(3)
    for shard, (lo, hi) in zip(shards, ((0, 4), (4, 8), (8, 12)), strict=True):
        got = StoreClient(queue).load(shard)
        for key in whole.tensor_keys:
            assert torch.equal(got[key], whole[key][lo:hi]), key
        assert got.meta == whole.meta == {TEMPERATURE_KEY: 0.7}
        assert got["score"].tolist() == list(range(lo, hi))
        assert list(got.non_tensors["uid"]) == list(whole.non_tensors["uid"][lo:hi])


def test_image_rows_through_the_queue_keep_each_prompts_media_once():
    """Streamed puts (one per prompt group) of image rows: every shard rebuilds the driver
    batch's rows with their prompt's media, and the queue holds each prompt's media once."""
    n, media = 3, [_prompt_media(4), _prompt_media(5)]
    rng = random.Random(5)
    prompts, responses, logps, _ = _random_rollout(rng, 2 * n, False)
    whole = build_rollout_batch(prompts, responses, 0, logps, None)
    queue = make_transfer_queue("local")
    for p, m in enumerate(media):
        lo, hi = p * n, (p + 1) * n
        part = build_rollout_batch(prompts[lo:hi], responses[lo:hi], 0, logps[lo:hi], None)
        part.non_tensors["uid"] = [f"u{p}"] * n
        part.non_tensors[MULTI_MODAL] = [m] * n  # the producer's rows share the prompt's object
        part["score"] = torch.zeros(n)
        part["acc"] = torch.zeros(n)
        queue.put(sample_rows(part), "step-1", sample_ids=list(range(lo, hi)))
    held = queue.storage_bytes()
    queue.put(Batch({}, {MULTI_MODAL: [None] * 2 * n}), "probe", sample_ids=range(2 * n))
    none_bytes = queue.storage_bytes() - held
    queue.clear("probe")
    meta = queue.get_meta(["prompt_ids", MULTI_MODAL], 2 * n, "step-1", consumer="trainer")
    layout = StepLayout(max(map(len, prompts)), max(map(len, responses)), pad_id=0)
    for shard, (lo, hi) in zip(meta.chunk(2), ((0, 3), (3, 6)), strict=True):
        got = layout.load(queue, shard, [MULTI_MODAL])
        for key in whole.tensor_keys:
            assert torch.equal(got[key], whole[key][lo:hi]), key
        assert all(row is media[lo // n] for row in got.non_tensors[MULTI_MODAL])
    # Dropping the media column of every row frees exactly one copy per prompt.
    queue.put(Batch({}, {MULTI_MODAL: [None] * 2 * n}), "step-1", sample_ids=range(2 * n))
    assert held - queue.storage_bytes() == sum(value_nbytes(m) for m in media) - none_bytes


def test_merge_rollout_summaries_adds_counts_and_weights_means():
    merged = merge_rollout_summaries(
        [
            {"rows": 2, "width_prompt": 5, "reward/errors": 1, "num_turns/mean": 1.0},
            {"rows": 6, "width_prompt": 7, "reward/errors": 0, "num_turns/mean": 3.0},
        ]
    )
    assert merged == {
        "rows": 8.0,
        "width_prompt": 7.0,
        "reward/errors": 1.0,
        "num_turns/mean": (2 * 1.0 + 6 * 3.0) / 8,
    }


def test_transfer_needs_rows_divisible_by_the_ranks():
    with pytest.raises(ConfigError, match="transfer.enable"):
        RLTrainer(
            load_config(
                "demo",
                [
                    "transfer.enable=true",
                    "trainer.n_gpus_per_node=3",
                    "data.train_batch_size=4",
                    "rollout.n=2",
                ],
            )
        )


def _metrics(path: Path) -> list[dict]:
    lines = (path / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "critic/score/mean" in r]


def _same_metrics(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    skip = ("timing_s/", "perf/throughput", "transfer/")
    for ra, rb in zip(a, b, strict=True):
        keys = {k for k in ra if not k.startswith(skip) and k != "time"}
        assert keys <= set(rb), keys - set(rb)
        for key in sorted(keys):
            if key == "rollout/log_prob_gap":
                # The servers' own log-probs depend on which requests share a decode batch
                # (two rollout workers vs one client): equal to float rounding only.
                assert ra[key] == pytest.approx(rb[key], abs=1e-6)
                continue
            assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])


@pytest.mark.slow
@pytest.mark.parametrize(
    "estimator,steps",
    [("grpo", 3), ("remax", 2)],  # remax: greedy baselines streamed too
)
def test_local_run_gives_the_same_metrics_with_and_without_the_queue(tmp_path, estimator, steps):
    extra = (
        "trainer.worker_backend=local",
        f"trainer.total_steps={steps}",
        f"algorithm.adv_estimator={estimator}",
        "actor.use_kl_loss=true",
        "actor.ppo_mini_batch_size=4",  # two mini-batches: old log-probs are computed
        "actor.lr=0.01",
        "rollout.num_threads=1",  # the replica's own thread count reaches its command line
    )
    for name, flag in (("plain", "false"), ("queue", "true")):
        cfg = load_config("demo", _e2e_overrides(tmp_path, name, *extra, f"transfer.enable={flag}"))
        RLTrainer(cfg).fit()
    plain, queued = _metrics(tmp_path / "plain"), _metrics(tmp_path / "queue")
    _same_metrics(plain, queued)
    assert all(r["transfer/storage_bytes"] > 0 for r in queued)
    assert plain[-1]["actor/pg_loss"] != plain[0]["actor/pg_loss"]


@pytest.mark.slow
def test_ppo_on_ray_at_world_size_two_gives_the_same_metrics_through_the_queue(
    tmp_path, ray_session
):
    extra = (
        "trainer.worker_backend=ray",
        "trainer.total_steps=2",
        "trainer.n_gpus_per_node=2",
        "model.tiny_size=nano",
        "actor.ppo_mini_batch_size=4",
        "trainer.save_freq=0",
    )
    for name, flag in (("plain", "false"), ("queue", "true")):
        cfg = load_config("ppo", _e2e_overrides(tmp_path, name, *extra, f"transfer.enable={flag}"))
        RLTrainer(cfg).fit()
    plain, queued = _metrics(tmp_path / "plain"), _metrics(tmp_path / "queue")
    _same_metrics(plain, queued)
    assert "critic/vf_loss" in queued[-1] and "actor/reward_kl_penalty" in queued[-1]
