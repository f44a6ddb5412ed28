"""Weighted prompt sampling: file mixing by weight, the pass-rate curriculum, and resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from polyrl.data.mixing import WeightedSampler


def test_sources_are_drawn_in_the_shares_of_their_weights_whatever_their_sizes():
    # Three files of 50, 200 and 750 prompts, weighted 0.5 / 0.3 / 0.2.
    sources = [0] * 50 + [1] * 200 + [2] * 750
    sampler = WeightedSampler(sources, batch_size=8, weights=[0.5, 0.3, 0.2], seed=3)
    drawn = [i for _ in range(125) for i in sampler.next_batch()]  # 1,000 prompts
    shares = np.bincount(np.asarray(sources)[drawn], minlength=3) / len(drawn)
    assert len(drawn) == 1000
    assert shares == pytest.approx([0.5, 0.3, 0.2], abs=0.03)
    # A batch never holds one prompt twice.
    assert all(len(set(sampler.next_batch())) == 8 for _ in range(20))


def test_prompts_always_solved_are_drawn_less():
    sampler = WeightedSampler([0] * 40, batch_size=4, seed=0, curriculum=True, min_weight=0.1)
    solved = set(range(20))  # half the prompts are always solved, the rest half the time

    def run(batches):
        counts = np.zeros(40, dtype=int)
        for _ in range(batches):
            batch = sampler.next_batch()
            counts[batch] += 1
            sampler.record(batch, [1.0 if i in solved else 0.5 for i in batch])
        return counts

    first = run(50)
    assert first.sum() == 200
    later = run(200)
    easy, informative = later[:20].sum(), later[20:].sum()
    # Weights 0.1 against 1: about one draw in eleven goes to a solved prompt.
    assert easy < 0.25 * informative, (easy, informative)
    assert sampler.pass_rate(0) == 1.0 and sampler.pass_rate(39) == 0.5
    assert sampler.pass_rate(0) is not None
    # Without the curriculum the same outcomes change nothing.
    plain = WeightedSampler([0] * 40, batch_size=4, seed=0)
    plain.record([0], [1.0])
    assert np.allclose(plain.probabilities(), 1 / 40)


def test_a_resumed_sampler_continues_the_same_sequence():
    def drive(sampler, batches):
        out = []
        for _ in range(batches):
            batch = sampler.next_batch()
            out.append(batch)
            sampler.record(batch, [float(i % 3 == 0) for i in batch])  # a fixed outcome each
        return out

    def fresh():
        return WeightedSampler(
            [0] * 30 + [1] * 10, batch_size=4, weights=[1.0, 3.0], seed=7, curriculum=True
        )

    whole = drive(fresh(), 30)
    first = fresh()
    head = drive(first, 12)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint holds it
    resumed = fresh()
    resumed.load_state_dict(state)
    assert head + drive(resumed, 18) == whole
    assert resumed.epoch == 30 // resumed.batches_per_epoch
    other = WeightedSampler([0] * 30 + [1] * 10, batch_size=4, weights=[1.0, 1.0], seed=7)
    with pytest.raises(ValueError, match="weights"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="another sampler"):
        other.load_state_dict({"epoch": 0, "position": 0})


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="one each"):
        WeightedSampler([0, 0, 1, 1], 2, weights=[1.0])
    with pytest.raises(ValueError, match=">= 0"):
        WeightedSampler([0, 0, 1, 1], 2, weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="positive weight"):
        WeightedSampler([0, 0, 1, 1], 3, weights=[1.0, 0.0])


def test_the_dataset_knows_the_file_of_each_prompt(tmp_path, tiny_qwen2_tokenizer):
    from polyrl.data.dataset import RLDataset

    paths = []
    for name, count in (("a", 2), ("b", 3)):
        path = tmp_path / f"{name}.jsonl"
        rows = [
            {"prompt": f"{name} {i}", "data_source": name, "reward_model": {"ground_truth": "1"}}
            for i in range(count)
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(path))
    ds = RLDataset(paths, tiny_qwen2_tokenizer, max_prompt_length=64)
    assert ds.file_indices == [0, 0, 1, 1, 1]


def test_the_config_wants_one_weight_per_training_file():
    from polyrl.config import ConfigError, load_config

    cfg = load_config(
        "grpo", ["data.train_files=[a.parquet,b.parquet]", "data.train_file_weights=[0.7,0.3]"]
    )
    assert cfg.data.train_file_weights == [0.7, 0.3]
    with pytest.raises(ConfigError, match="train_file_weights"):
        load_config(
            "grpo", ["data.train_files=[a.parquet,b.parquet]", "data.train_file_weights=[1]"]
        )
    with pytest.raises(ConfigError, match="curriculum"):
        load_config("grpo", ["data.curriculum=hardest"])
