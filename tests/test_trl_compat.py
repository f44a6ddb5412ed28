"""TRL users' scripts: reward_funcs with weights, TRL-style datasets, RLConfig() defaults,
TRL's configs (args=GRPOConfig(...), peft_config=) and its quick starts."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import datasets
import numpy as np
import pytest
import yaml

from polyrl import (
    DPOConfig,
    GRPOConfig,
    GRPOTrainer,
    PPOTrainer,
    RewardConfig,
    RewardModelTrainer,
    RLConfig,
    RLOOConfig,
    RLOOTrainer,
)
from polyrl.config import ConfigError, ConfigNote, trl_compat
from polyrl.config.trl_compat import GKDConfig
from polyrl.core.batch import Batch
from polyrl.data.dataset import RLDataset
from polyrl.data.schema import RowValidationError
from polyrl.reward import RewardFailureError, RewardFunctionError
from polyrl.reward.functions import RewardFunctionsManager, resolve_reward_functions
from polyrl.reward.user_fn import RewardResultError
from polyrl.trainer.rl.checks import check_config

PROMPTS = ["1+1=", "2+2=", "3+1=", "2+5=", "4+4=", "1+3=", "6+2=", "5+4="]
ANSWERS = ["2", "4", "4", "7", "8", "4", "8", "9"]

# What the batched functions saw, per call (they run in this process).
CALLS: dict[str, list[dict]] = {}


def contains_answer(prompts, completions, completion_ids, answer, **kwargs):
    CALLS.setdefault("contains_answer", []).append(
        {"prompts": prompts, "completions": completions, "ids": completion_ids, "answer": answer}
    )
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    values = [1.0 if a in t else 0.0 for t, a in zip(texts, answer, strict=True)]
    CALLS["contains_answer"][-1]["values"] = values
    return values


def short(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    values = [-len(t) / 10.0 for t in texts]
    CALLS.setdefault("short", []).append({"values": values, "kwargs": sorted(kwargs)})
    return values


def wrong_length(completions, **kwargs):
    return [1.0, 0.0, 1.0]


def _dataset(conversational: bool = False):
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS] if conversational else PROMPTS
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": ANSWERS})


def _config(tmp_path: Path, name: str, **groups) -> RLConfig:
    """A plain RLConfig() made small enough for a CPU step in a few seconds."""
    cfg = RLConfig()
    cfg.trainer.output_dir = str(tmp_path / name)
    cfg.trainer.total_steps = 2
    cfg.trainer.loggers = ["jsonl"]
    cfg.trainer.device = "cpu"
    cfg.trainer.export_hf = False
    cfg.trainer.worker_backend = "local"  # RLConfig()'s ray is tested elsewhere; no Ray here
    cfg.data.train_batch_size = 4
    cfg.data.max_prompt_length = 64
    cfg.data.max_response_length = 8
    cfg.rollout.max_new_tokens = 8
    cfg.reward.num_workers = 0
    for group, values in groups.items():
        for key, value in values.items():
            setattr(getattr(cfg, group), key, value)
    return cfg


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _obj(values) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _batch(texts, rows, ids=None) -> Batch:
    n = len(texts)
    return Batch(
        non_tensors={
            "response_text": _obj(texts),
            "data_source": _obj(["custom"] * n),
            "ground_truth": _obj([None] * n),
            "extra_info": _obj([{k: v for k, v in r.items() if k != "prompt"} for r in rows]),
            "source_row": _obj(rows),
            "completion_ids": _obj(ids or [[1]] * n),
        }
    )


# ------------------------------------------------------------------ construction-time checks
def test_reward_function_problems_are_reported_at_construction(tiny_qwen2_dir):
    ds = _dataset()

    def make(**kwargs):
        return GRPOTrainer(model=str(tiny_qwen2_dir), train_dataset=ds, **kwargs)

    with pytest.raises(TypeError, match="#0 must be a callable"):
        make(reward_funcs=42)
    with pytest.raises(KeyError, match="'nosuch' is neither .* nor a registered scorer"):
        make(reward_funcs="nosuch")

    def needs_foo(completions, foo):
        return [0.0] * len(completions)

    with pytest.raises(TypeError, match="'needs_foo' requires parameter 'foo'.*columns: answer"):
        make(reward_funcs=[short, needs_foo])

    def per_sample(response, mystery):
        return 0.0

    with pytest.raises(RewardFunctionError, match="'per_sample'.*'mystery'"):
        make(reward_funcs=per_sample)
    with pytest.raises(RewardFunctionError, match="'<lambda>'.*cannot be pickled"):
        make(reward_funcs=lambda response: 1.0, config=RLConfig(reward={"num_workers": 2}))
    with pytest.raises(ValueError, match="2 values for 1 reward functions"):
        make(reward_funcs=[short], reward_weights=[1.0, 2.0])
    with pytest.raises(TypeError, match="not both"):
        make(reward_funcs=short, reward_fn=short)
    with pytest.raises(FileNotFoundError):
        make(reward_funcs="no/such/file.py:fn")
    # The old single-function argument checks its signature now too, and takes TRL functions.
    with pytest.raises(RewardFunctionError, match="mystery"):
        make(reward_fn=per_sample)
    trainer = make(reward_fn=short)
    assert [f.name for f in trainer._reward_fn] == ["short"]
    # Names stay unique (metrics keys); weights default to 1.
    funcs = make(reward_funcs=[short, short, "arithmetic"])._reward_fn
    assert [(f.name, f.weight, f.batched) for f in funcs] == [
        ("short", 1.0, True),
        ("short_2", 1.0, True),
        ("arithmetic", 1.0, False),
    ]


def test_rows_without_a_reward_need_the_schema_fields(tiny_qwen2_dir):
    with pytest.raises(RowValidationError, match="no data_source or reward_model.*reward_funcs="):
        GRPOTrainer(model=str(tiny_qwen2_dir), train_dataset=_dataset())
    with pytest.raises(TypeError, match="DatasetDict"):
        GRPOTrainer(
            model=str(tiny_qwen2_dir),
            reward_funcs=short,
            train_dataset=datasets.DatasetDict({"train": _dataset()}),
        )


def test_trl_rows_need_only_a_prompt_and_keep_their_columns(tiny_qwen2_tokenizer):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4", "extra_info": {}}]
    with pytest.raises(RowValidationError, match="needs only its prompt when a reward function"):
        RLDataset(rows, tiny_qwen2_tokenizer, max_prompt_length=64)
    ds = RLDataset(rows, tiny_qwen2_tokenizer, max_prompt_length=64, require_reward_fields=False)
    item = ds[0]
    assert item["data_source"] == "custom"
    assert item["reward_model"] == {"ground_truth": None}
    assert item["extra_info"] == {"answer": "2"}  # verl-style functions see the columns here
    assert item["prompt"] == [{"role": "user", "content": "1+1="}]
    assert item["source_row"] == {"prompt": "1+1=", "answer": "2"}  # as given: TRL functions
    assert ds[1]["extra_info"] == {"answer": "4"}


def test_trl_path_templates_only_conversational_prompts(tmp_path, tiny_qwen2_dir):
    """As in TRL: a plain-string prompt is tokenized as it is, chat messages are templated;
    polyrl's own configs keep templating strings (RLConfig()'s default)."""
    from polyrl.core.prompts import TEXT_PROMPT_KEY
    from polyrl.models.loader import load_tokenizer
    from polyrl.trainer.rl.build import load_datasets

    tok = load_tokenizer(tiny_qwen2_dir)
    messages = [{"role": "user", "content": "2+2="}]
    rows = [{"prompt": "2+2=", "answer": "4"}, {"prompt": messages, "answer": "4"}]
    trainer = GRPOTrainer(model=str(tiny_qwen2_dir), reward_funcs=short, train_dataset=rows)
    assert trainer.config.data.template_string_prompts is False
    assert RLConfig().data.template_string_prompts is True
    train, _ = load_datasets(trainer.config, tok, tmp_path, train_rows=rows, custom_reward=True)
    templated = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    assert train.input_ids[0] == tok.encode("2+2=", add_special_tokens=False)
    assert train.input_ids[1] == templated != train.input_ids[0]
    assert train[0][TEXT_PROMPT_KEY] == "2+2=" and TEXT_PROMPT_KEY not in train[1]
    assert train[0]["source_row"]["prompt"] == "2+2="  # what batched rewards receive
    # The CLI and verl-style configs: a string is one user message, templated.
    cli, _ = load_datasets(RLConfig(), tok, tmp_path, train_rows=rows, custom_reward=True)
    assert cli.input_ids == [templated, templated] and TEXT_PROMPT_KEY not in cli[0]


# ------------------------------------------------------------------ RLConfig() per trainer
def test_each_trainer_runs_from_a_plain_rlconfig(tiny_qwen2_dir):
    ds = _dataset()
    grpo = GRPOTrainer(model=str(tiny_qwen2_dir), reward_funcs=short, train_dataset=ds)
    assert grpo.config.rollout.n == 8
    assert grpo.applied_defaults == {"rollout.n": 8, "data.template_string_prompts": False}
    for cls, estimator, n in (
        (GRPOTrainer, "grpo", 8),
        (RLOOTrainer, "rloo", 8),
        (PPOTrainer, "gae", 1),
    ):
        trainer = cls(str(tiny_qwen2_dir), config=RLConfig(), reward_funcs=short, train_dataset=ds)
        cfg = trainer.config
        assert (cfg.algorithm.adv_estimator, cfg.rollout.n) == (estimator, n)
        check_config(cfg, has_rows=True, has_model=True)
    # A value the user set wins over the trainer's default.
    mine = RLConfig(rollout={"n": 4})
    trainer = GRPOTrainer(str(tiny_qwen2_dir), config=mine, reward_funcs=short, train_dataset=ds)
    assert trainer.config.rollout.n == 4 and "rollout.n" not in trainer.applied_defaults
    assert mine.rollout.n == 4 and RLConfig().rollout.n == 1  # the user's object is not changed


# ------------------------------------------------------------------ the manager, no training
def test_weighted_sum_skips_none_and_reports_each_function():
    def maybe(completions, **kwargs):
        return [None, 1.0, None]

    def never(completions, **kwargs):
        return [None, None, None]

    funcs = resolve_reward_functions([contains_answer, maybe, never], [1.0, 2.0, 5.0])
    rows = [{"prompt": "p", "answer": a} for a in ("4", "5", "6")]
    with RewardFunctionsManager(funcs, num_workers=0) as manager:
        result = manager.score(_batch(["4", "x", "y6"], rows))
    assert result.scores.tolist() == [1.0, 2.0, 1.0]
    m = result.metrics
    assert m["rewards/contains_answer/mean"] == pytest.approx(2 / 3)
    assert m["rewards/maybe/mean"] == 1.0 and m["rewards/maybe/std"] == 0.0
    assert math.isnan(m["rewards/never/mean"])
    assert m["reward/unscored"] == 0.0
    with RewardFunctionsManager(resolve_reward_functions(never), num_workers=0) as manager:
        result = manager.score(_batch(["a", "b", "c"], rows))
    assert result.scores.tolist() == [0.0, 0.0, 0.0] and result.metrics["reward/unscored"] == 3


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (lambda n: [1.0] * (n - 1), r"'bad' returned a list of 2 values for a batch of 3"),
        (lambda n: 1.0, r"'bad' returned float 1.0 for a batch of 3 completions"),
        (lambda n: ["1"] * n, r"'bad' returned str '1' for completion 0 of 3"),
        (lambda n: [[1.0]] * n, r"'bad' returned a list of 1 values \(\[1.0\]\) for completion 0"),
    ],
)
def test_batched_function_returning_the_wrong_thing_raises(returned, message):
    def bad(completions, **kwargs):
        return returned(len(completions))

    rows = [{"prompt": "p"}] * 3
    with RewardFunctionsManager(resolve_reward_functions(bad), num_workers=0) as manager:
        with pytest.raises(RewardResultError, match=message):
            manager.score(_batch(["a", "b", "c"], rows))


def test_batched_function_that_raises_follows_max_failure_fraction():
    def broken(completions, **kwargs):
        raise ValueError("broke on purpose")

    rows = [{"prompt": "p"}] * 2
    funcs = resolve_reward_functions([broken, short])
    with RewardFunctionsManager(funcs, num_workers=0, max_failure_fraction=0.5) as manager:
        with pytest.raises(RewardFailureError, match="'broken' raised.*broke on purpose"):
            manager.score(_batch(["a", "b"], rows))
    with RewardFunctionsManager(
        funcs, num_workers=0, max_failure_fraction=1.0, error_reward=-1.0
    ) as manager:
        result = manager.score(_batch(["a", "bb"], rows))
    assert result.scores.tolist() == pytest.approx([-1.1, -1.2])
    assert result.metrics["reward/errors"] == 2.0 and result.statuses == ["error", "error"]


def test_per_sample_function_returning_a_list_raises_naming_it(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def my_reward(solution_str):\n    return [1.0, 0.0, 1.0]\n")
    rows = [{"prompt": "p"}] * 2
    # In a worker process (the default) and in-process.
    for workers in (1, 0):
        funcs = resolve_reward_functions(f"{path}:my_reward")
        with RewardFunctionsManager(funcs, num_workers=workers) as manager:
            with pytest.raises(RewardResultError, match=r"'my_reward' returned a list of 3 values"):
                manager.score(_batch(["a", "b"], rows))


def test_datasets_is_a_dependency():
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert any(d.startswith("datasets") for d in pyproject["project"]["dependencies"])


# ------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_trl_script_trains_with_weighted_batched_rewards(tmp_path, tiny_qwen2_dir):
    CALLS.clear()
    cfg = _config(tmp_path, "trl", rollout={"n": 2})
    trainer = GRPOTrainer(
        model=str(tiny_qwen2_dir),
        reward_funcs=[contains_answer, short],
        reward_weights=[1.0, 0.5],
        train_dataset=_dataset(),
        config=cfg,
    )
    summary = trainer.train()
    assert summary["steps"] == 2
    records = [r for r in _records(tmp_path / "trl") if "critic/score/mean" in r]
    assert len(records) == 2
    first = records[0]
    for name in ("contains_answer", "short"):
        assert f"rewards/{name}/mean" in first and f"rewards/{name}/std" in first
    # The recorded score is the weighted sum of what the functions returned...
    a, s = CALLS["contains_answer"][0]["values"], CALLS["short"][0]["values"]
    expected = np.mean([x + 0.5 * y for x, y in zip(a, s, strict=True)])
    assert first["critic/score/mean"] == pytest.approx(expected, abs=1e-5)
    assert first["rewards/contains_answer/mean"] == pytest.approx(np.mean(a))
    # ... and of the per-function means recorded beside it.
    assert first["critic/score/mean"] == pytest.approx(
        first["rewards/contains_answer/mean"] + 0.5 * first["rewards/short/mean"], abs=1e-5
    )
    # The answer column reached the function, aligned with the prompts (n=2 copies each).
    call = CALLS["contains_answer"][0]
    assert len(call["prompts"]) == len(call["answer"]) == 4 * 2
    for prompt, answer in zip(call["prompts"], call["answer"], strict=True):
        assert isinstance(prompt, str) and ANSWERS[PROMPTS.index(prompt)] == answer
    assert all(isinstance(c, str) for c in call["completions"])
    assert all(isinstance(ids, list) and len(ids) <= 8 for ids in call["ids"])
    assert CALLS["short"][0]["kwargs"] == ["answer", "completion_ids", "prompts"]


@pytest.mark.slow
def test_conversational_prompts_with_a_plain_rlconfig(tmp_path, tiny_qwen2_dir):
    CALLS.clear()
    verl = tmp_path / "verl_reward.py"
    verl.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert data_source == 'custom' and extra_info['answer'] in '2477889'\n"
        "    return 1.0 if extra_info['answer'] in solution_str else 0.0\n"
    )
    cfg = _config(tmp_path, "chat", trainer={"total_steps": 1}, reward={"num_workers": 1})
    trainer = GRPOTrainer(
        model=str(tiny_qwen2_dir),
        reward_funcs=[contains_answer, f"{verl}:compute_score"],
        train_dataset=_dataset(conversational=True),
        config=cfg,
    )
    assert trainer.config.rollout.n == 8  # GRPO's default over RLConfig()'s n=1
    trainer.train()
    call = CALLS["contains_answer"][0]
    assert len(call["completions"]) == 4 * 8
    assert call["prompts"][0] in [[{"role": "user", "content": p}] for p in PROMPTS]
    for completion in call["completions"]:
        assert isinstance(completion, list) and len(completion) == 1
        assert completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)
    (record,) = [r for r in _records(tmp_path / "chat") if "critic/score/mean" in r]
    assert "rewards/compute_score/mean" in record and record["reward/garbage"] == 0.0


@pytest.mark.slow
def test_wrong_return_stops_the_first_step(tmp_path, tiny_qwen2_dir):
    cfg = _config(tmp_path, "wrong", rollout={"n": 2})
    trainer = GRPOTrainer(
        model=str(tiny_qwen2_dir),
        reward_funcs=wrong_length,
        train_dataset=_dataset(),
        config=cfg,
    )
    with pytest.raises(
        RewardResultError,
        match=r"'wrong_length' returned a list of 3 values for a batch of 8 completions",
    ):
        trainer.train()


def test_config_custom_function_may_be_batched_and_rows_need_only_a_prompt(tmp_path):
    from polyrl.trainer.rl.rollout import has_custom_reward, reward_manager

    path = tmp_path / "trl_reward.py"
    path.write_text("def reward(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    cfg = RLConfig(reward={"custom_function": f"{path}:reward", "num_workers": 0})
    assert has_custom_reward(cfg)  # polyrl train: rows then need only a prompt
    manager = reward_manager(cfg)
    try:
        assert isinstance(manager, RewardFunctionsManager)
        assert [f.name for f in manager.functions] == ["reward"]
        result = manager.score(_batch(["a", "b"], [{"prompt": "p"}] * 2))
        assert result.scores.tolist() == [1.0, 1.0]
    finally:
        manager.close()


# ------------------------------------------------------------------ TRL's configs (args=)
TRL_CLASSES = (GRPOConfig, RLOOConfig, DPOConfig, RewardConfig, GKDConfig)


def reward_len(completions, **kwargs):
    """TRL's quick-start reward: completions close to 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def _resolved(run_dir: Path, name: str) -> dict:
    """The run's resolved config (its YAML, every auto resolved)."""
    return yaml.safe_load((run_dir / name).read_text())


@pytest.mark.parametrize("cls", TRL_CLASSES)
def test_each_trl_field_has_one_row_and_the_docs_show_the_table(cls):
    rows = [row.field for row in cls.rows()]
    assert sorted(rows) == sorted(f.name for f in dataclasses.fields(cls)), "one row per field"
    doc = (Path(__file__).parents[1] / "docs" / "migrating_from_trl.md").read_text()
    assert trl_compat.markdown_table() in doc, "regenerate: python -m polyrl.config.trl_compat"


def test_trl_defaults_mean_what_they_mean_in_trl():
    cfg = GRPOConfig().to_polyrl()
    assert (cfg.actor.optim.lr, cfg.actor.optim.lr_scheduler, cfg.rollout.n) == (1e-6, "linear", 8)
    assert (cfg.data.max_prompt_length, cfg.data.truncation) == (512, "error")  # TRL: no limit
    assert cfg.rollout.top_k == -1 and cfg.actor.entropy_coeff == 0.0
    assert cfg.data.max_response_length == cfg.rollout.max_new_tokens == 256
    assert cfg.data.train_batch_size == cfg.actor.ppo_mini_batch_size == 1  # 8 completions / 8
    assert not cfg.actor.use_kl_loss and cfg.actor.loss_agg_mode == "token-mean"  # beta 0, dapo
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high, cfg.actor.clip_ratio_c) == (
        0.2,
        0.2,
        0.0,
    )
    assert cfg.actor.policy_loss == "ppo_clip" and cfg.algorithm.norm_adv_by_std
    assert (cfg.trainer.total_epochs, cfg.trainer.total_steps, cfg.trainer.save_freq) == (3, 0, 500)
    assert cfg.actor.gradient_checkpointing and cfg.rollout.backend == "native"
    assert (cfg.trainer.output_dir, cfg.seed, cfg.model.compute_dtype) == (
        "trainer_output",
        42,
        "auto",
    )
    rloo = RLOOConfig().to_polyrl()
    assert (rloo.rollout.n, rloo.data.train_batch_size) == (2, 4)
    assert rloo.algorithm.use_kl_in_reward and rloo.algorithm.kl_coef == 0.05
    assert not rloo.actor.use_kl_loss and rloo.actor.loss_agg_mode == "seq-mean-token-sum"
    legacy = GRPOConfig(max_prompt_length=128).to_polyrl()  # TRL before 1.0: cut on the left
    assert (legacy.data.max_prompt_length, legacy.data.truncation) == (128, "left")
    dpo = DPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2).to_polyrl()
    assert (dpo.dpo.beta, dpo.dpo.loss_type, dpo.dpo.optim.lr) == (0.1, "sigmoid", 1e-6)
    assert (dpo.dpo.max_length, dpo.data.train_batch_size) == (1024, 8)
    rm = RewardConfig(center_rewards_coefficient=0.01).to_polyrl()
    assert (rm.rm.optim.lr, rm.rm.center_rewards_coefficient, rm.rm.max_length) == (
        1e-4,
        0.01,
        1024,
    )


def test_trl_fields_polyrl_cannot_honour_are_named_in_one_note():
    args = GRPOConfig(
        num_generations=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        logging_steps=5,
        warmup_steps=10,
        save_strategy="epoch",
        report_to=["wandb"],
        epsilon=0.1,
        epsilon_high=0.28,
        beta=0.04,
        loss_type="dr_grpo",
        importance_sampling_level="sequence",
        scale_rewards="none",
        top_k=0,
        max_steps=3,
    )
    with pytest.warns(ConfigNote) as notes:
        cfg = args.to_polyrl()
    (note,) = [str(n.message) for n in notes]
    assert args.unhonoured() == ["warmup_steps=10", "logging_steps=5", "save_strategy='epoch'"]
    for field in args.unhonoured():
        assert field in note
    # 16 completions per generation (4 x 4 steps), 8 per optimizer step, 4 per prompt.
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size) == (4, 2)
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.1, 0.28)
    assert (cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type) == (
        True,
        0.04,
        "k3",
    )
    assert (cfg.actor.loss_agg_mode, cfg.actor.policy_loss) == ("seq-mean-token-sum-norm", "gspo")
    assert not cfg.algorithm.norm_adv_by_std and cfg.rollout.top_k == -1
    assert cfg.trainer.loggers == ["console", "wandb"] and cfg.trainer.total_steps == 3
    # Values that would train another objective are errors, not notes.
    for bad in (
        GRPOConfig(loss_type="sapo"),
        GRPOConfig(scale_rewards="batch"),
        GRPOConfig(delta=2.0),
        DPOConfig(loss_type="hinge"),
        DPOConfig(loss_type=["sigmoid", "bco_pair"]),
    ):
        with pytest.raises(ConfigError, match="polyrl has no"):
            bad.to_polyrl()
    with pytest.raises(ConfigError, match="multiple of num_generations"):
        GRPOConfig(per_device_train_batch_size=6).to_polyrl()
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_generation'"):
        GRPOConfig(num_generation=4)


def test_trl_cispo_and_vllm_importance_sampling_map():
    cfg = GRPOConfig(loss_type="cispo", epsilon_high=5.0).to_polyrl()
    actor = cfg.actor
    assert (actor.policy_loss, actor.loss_agg_mode) == ("cispo", "token-mean")
    # TRL caps the weight at epsilon_high with no floor: clip(r, 1 - 1, 1 + 4).
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (1.0, 4.0)
    with pytest.raises(ConfigError, match="epsilon_high"):
        GRPOConfig(loss_type="cispo").to_polyrl()  # epsilon 0.2 would cap every weight below 1
    # The correction applies with use_vllm only, as in TRL.
    assert GRPOConfig().to_polyrl().algorithm.rollout_is == "none"
    cfg = GRPOConfig(
        use_vllm=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_cap=3.0,
    ).to_polyrl()
    assert (cfg.algorithm.rollout_is, cfg.algorithm.rollout_is_threshold) == ("token", 3.0)
    assert GRPOConfig(use_vllm=True).to_polyrl().algorithm.rollout_is == "sequence"
    off = GRPOConfig(use_vllm=True, vllm_importance_sampling_correction=False)
    assert off.to_polyrl().algorithm.rollout_is == "none"
    masked = GRPOConfig(use_vllm=True, vllm_importance_sampling_mode="token_mask")
    assert masked.unhonoured() == ["vllm_importance_sampling_mode='token_mask'"]


def test_peft_lora_config_maps_onto_the_lora_options(tiny_qwen2_dir):
    peft = pytest.importorskip("peft")
    options = trl_compat.lora_options(
        peft.LoraConfig(r=8, lora_alpha=32, lora_dropout=0.05), tiny_qwen2_dir
    )
    assert options == {
        "model.lora_rank": 8,
        "model.lora_alpha": 32.0,
        "model.lora_dropout": 0.05,
        "model.target_modules": ["q_proj", "v_proj"],  # peft's default for qwen2
    }
    lora = peft.LoraConfig(r=4, target_modules="all-linear", use_rslora=True, bias="all")
    with pytest.warns(ConfigNote, match="use_rslora=True") as notes:
        options = trl_compat.lora_options(lora, tiny_qwen2_dir)
    assert "bias='all'" in str(notes[0].message) and options["model.target_modules"] == [
        "all-linear"
    ]
    with pytest.raises(ConfigError, match="a pattern"):
        trl_compat.lora_options(peft.LoraConfig(target_modules=".*proj"), tiny_qwen2_dir)


def test_trainers_take_trl_arguments(tiny_qwen2_dir):
    ds = _dataset()
    with pytest.raises(TypeError, match="not both"):
        GRPOTrainer(
            tiny_qwen2_dir,
            config=RLConfig(),
            args=GRPOConfig(),
            reward_funcs=short,
            train_dataset=ds,
        )
    with pytest.raises(TypeError, match="GRPOTrainer takes a GRPOConfig"):
        GRPOTrainer(tiny_qwen2_dir, args=DPOConfig(), reward_funcs=short, train_dataset=ds)
    with pytest.raises(TypeError, match="PPOTrainer takes no TRL config"):
        PPOTrainer(tiny_qwen2_dir, args=GRPOConfig(), reward_funcs=short, train_dataset=ds)
    # num_generations=1 is the user's, not overridden by GRPOTrainer's own default of 8.
    args = GRPOConfig(num_generations=1, per_device_train_batch_size=2, reward_weights=[2.0])
    trainer = GRPOTrainer(
        model=str(tiny_qwen2_dir), reward_funcs=short, args=args, train_dataset=ds
    )
    assert trainer.config.rollout.n == 1 and trainer.config.data.template_string_prompts is False
    assert [f.weight for f in trainer._reward_fn] == [2.0]
    from polyrl import trl

    assert trl.RewardTrainer is RewardModelTrainer and trl.GRPOConfig is GRPOConfig


def _grpo_quick_start(model: str, output_dir: str):
    """TRL's GRPO quick start; only the import, the model path and max_steps are changed."""
    from datasets import Dataset
    from peft import LoraConfig

    from polyrl import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_dict({"prompt": PROMPTS})

    training_args = GRPOConfig(
        output_dir=output_dir,
        learning_rate=1e-5,
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=8,
        beta=0.04,
        epsilon_high=0.28,
        loss_type="grpo",
        temperature=0.9,
        logging_steps=10,
        max_steps=2,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_len,
        args=training_args,
        train_dataset=dataset,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    return trainer.train()


@pytest.mark.slow
def test_trl_grpo_quick_start_runs_with_the_import_changed(tmp_path, tiny_qwen2_dir):
    out = tmp_path / "Qwen2-0.5B-GRPO"
    summary = _grpo_quick_start(str(tiny_qwen2_dir), str(out))
    assert summary["steps"] == 2
    cfg = _resolved(out, "rl_config.yaml")
    actor, rollout, data = cfg["actor"], cfg["rollout"], cfg["data"]
    assert (actor["optim"]["lr"], actor["optim"]["lr_scheduler"]) == (1e-5, "linear")
    assert (rollout["n"], rollout["temperature"], rollout["max_new_tokens"]) == (2, 0.9, 8)
    assert (data["train_batch_size"], actor["ppo_mini_batch_size"]) == (2, 2)  # 4 / 2 per prompt
    assert (data["max_response_length"], data["max_prompt_length"]) == (8, 512)
    assert (actor["use_kl_loss"], actor["kl_loss_coef"], actor["kl_loss_type"]) == (
        True,
        0.04,
        "k3",
    )
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"], actor["clip_ratio_c"]) == (
        0.2,
        0.28,
        0.0,
    )
    assert (actor["loss_agg_mode"], actor["policy_loss"]) == ("seq-mean-token-mean", "ppo_clip")
    assert actor["gradient_checkpointing"] and cfg["algorithm"]["norm_adv_by_std"]
    assert cfg["algorithm"]["adv_estimator"] == "grpo" and cfg["trainer"]["total_steps"] == 2
    model = cfg["model"]
    assert (model["lora_rank"], model["lora_alpha"], model["target_modules"]) == (
        8,
        16.0,
        ["all-linear"],
    )


@pytest.mark.slow
def test_trl_dpo_quick_start_runs_with_the_import_changed(tmp_path, tiny_qwen2_dir):
    from datasets import Dataset

    from polyrl import DPOConfig, DPOTrainer  # was: from trl import DPOConfig, DPOTrainer
    from polyrl.models.loader import load_tokenizer

    tokenizer = load_tokenizer(tiny_qwen2_dir)  # was: AutoTokenizer.from_pretrained(...)
    train_dataset = Dataset.from_dict(
        {
            "prompt": PROMPTS,
            "chosen": [f" {a}" for a in ANSWERS],
            "rejected": [f" {int(a) + 1}" for a in ANSWERS],
        }
    )
    training_args = DPOConfig(
        output_dir=str(tmp_path / "Qwen2-0.5B-DPO"),
        per_device_train_batch_size=4,
        beta=0.2,
        max_length=64,
        logging_steps=10,
        max_steps=2,
    )
    trainer = DPOTrainer(
        model=str(tiny_qwen2_dir),
        args=training_args,
        processing_class=tokenizer,
        train_dataset=train_dataset,
    )
    trainer.train()
    cfg = _resolved(tmp_path / "Qwen2-0.5B-DPO", "dpo_config.yaml")
    dpo = cfg["dpo"]
    assert (dpo["beta"], dpo["loss_type"], dpo["max_length"]) == (0.2, "sigmoid", 64)
    assert (dpo["optim"]["lr"], dpo["optim"]["lr_scheduler"]) == (1e-6, "linear")
    assert dpo["gradient_checkpointing"] and cfg["data"]["train_batch_size"] == 4
    assert cfg["trainer"]["total_steps"] == 2


def test_gkd_names_map_onto_on_policy_distillation_and_other_objectives_are_refused():
    args = GKDConfig(
        lmbda=1.0,
        beta=1.0,
        temperature=1.0,
        max_new_tokens=16,
        teacher_model_name_or_path="/teacher",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )
    cfg = args.to_polyrl()
    assert (cfg.algorithm.distill_coef, cfg.algorithm.teacher_model_path) == (1.0, "/teacher")
    assert (cfg.rollout.n, cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size) == (1, 8, 8)
    assert cfg.rollout.max_new_tokens == cfg.data.max_response_length == 16
    for field, value in (("lmbda", 0.5), ("beta", 0.0), ("seq_kd", True)):
        bad = dataclasses.replace(args, **{field: value})
        with pytest.raises(ConfigError, match=f"GKDConfig.{field}="):
            bad.to_polyrl()
