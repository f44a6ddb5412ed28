"""verl compatibility: verl keys as polyrl aliases, the user's keys over the preset's, and
verl's own example launch lines run end to end as ``polyrl train``."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from test_rl_trainer import assert_policy_updated

from polyrl.config import (
    ConfigError,
    ConfigNote,
    PolyRLConfig,
    RLConfig,
    apply_overrides,
    load_config,
    verl_compat,
)
from polyrl.config.loader import _is_schema_path
from polyrl.core.batch import Batch

REPO = Path(__file__).resolve().parents[1]


def _load(preset: str | None, overrides: list[str]) -> tuple[PolyRLConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigNote)
        cfg = load_config(preset, overrides)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigNote)]


# ------------------------------------------------------------------ the user's keys win
def test_train_files_drop_the_presets_task_and_say_so():
    cfg, notes = _load("grpo", ["data.train_files=train.parquet"])
    assert cfg.data.task == "" and cfg.data.train_files == ["train.parquet"]
    assert any("data.task=arithmetic; dropped: data.train_files given" in n for n in notes)
    # Without train files the preset's task stays; an explicit task wins over the rule.
    assert load_config("grpo").data.task == "arithmetic"
    cfg, _ = _load("grpo", ["data.train_files=[a]", "data.task=countdown"])
    assert cfg.data.task == "countdown"


def test_total_epochs_drop_the_presets_total_steps():
    cfg, notes = _load("grpo", ["trainer.total_epochs=1"])
    assert cfg.trainer.total_steps == 0 and cfg.trainer.total_epochs == 1
    assert any("trainer.total_steps=100; dropped: trainer.total_epochs" in n for n in notes)
    cfg, notes = _load("grpo", ["trainer.total_epochs=3", "trainer.total_steps=7"])
    assert cfg.trainer.total_steps == 7
    assert any("both given: total_steps wins" in n for n in notes)
    cfg, notes = _load("grpo", ["trainer.total_steps=5"])
    assert cfg.trainer.total_steps == 5 and not notes


def test_max_response_length_sets_max_new_tokens_unless_given():
    cfg, notes = _load("grpo", ["data.max_response_length=64"])
    assert cfg.rollout.max_new_tokens == 64
    assert any("rollout.max_new_tokens=64 follows" in n for n in notes)
    cfg, _ = _load("grpo", ["data.max_response_length=64", "rollout.max_new_tokens=32"])
    assert cfg.rollout.max_new_tokens == 32
    # The agent loop caps a turn with max_new_tokens, the trajectory with the data length.
    cfg, _ = _load("grpo_tool", ["data.max_response_length=512"])
    assert cfg.rollout.max_new_tokens == 128


def test_override_order_does_not_matter_for_cross_field_checks():
    a = load_config(None, ["rollout.tensor_parallel_size=2", "rollout.backend=vllm"])
    b = load_config(None, ["rollout.backend=vllm", "rollout.tensor_parallel_size=2"])
    assert a == b
    with pytest.raises(ConfigError, match="tensor_parallel_size.*native backend"):
        load_config(None, ["rollout.tensor_parallel_size=2"])


def test_config_objects_take_mappings_and_check_assignments():
    cfg = RLConfig(rollout=dict(n=4), actor={"lr": 1})
    assert cfg.rollout.n == 4 and cfg.actor.lr == 1.0 and isinstance(cfg.actor.lr, float)
    with pytest.raises(ConfigError, match=r"rollout: unknown option 'nn'.*did you mean 'n'"):
        RLConfig(rollout=dict(nn=4))
    with pytest.raises(ConfigError, match=r"rollout.n: expected int, got str '4'"):
        RLConfig(rollout=dict(n="4"))
    with pytest.raises(ConfigError, match=r"ActorConfig.lr: expected float, got str '1e-6'"):
        cfg.actor.lr = "1e-6"
    with pytest.raises(ConfigError, match=r"RolloutConfig.n: value 0 out of range"):
        cfg.rollout.n = 0
    with pytest.raises(ConfigError, match=r"invalid value 'gpt2'"):
        cfg.model.tiny_arch = "gpt2"
    cfg.actor.lr = 2
    cfg.rollout = {"n": 3}
    assert cfg.actor.lr == 2.0 and cfg.rollout.n == 3


# ------------------------------------------------------------------------- verl keys
def test_verl_keys_set_the_polyrl_options_they_mean():
    cfg, notes = _load(
        "grpo",
        [
            "actor_rollout_ref.model.path=/models/qwen",
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.clip_ratio=0.3",
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.top_k=0",
            "actor_rollout_ref.rollout.response_length=24",
            "algorithm.kl_ctrl.kl_coef=0.01",
            "algorithm.kl_ctrl.type=adaptive",
            "custom_reward_function.path=/r.py",
            "trainer.logger=['console','file']",
            "trainer.total_training_steps=null",
            "trainer.save_freq=-1",
            "trainer.default_local_dir=/ckpt",
            "data.max_prompt_length=40",
            "data.max_response_length=24",
            "actor_rollout_ref.model.lora_rank=0",
            "reward_model.enable=False",
            "actor_rollout_ref.actor.fsdp_config.param_offload=True",
            "actor_rollout_ref.actor.fsdp_config.forward_prefetch=True",
        ],
    )
    assert cfg.model.path == "/models/qwen" and cfg.actor.lr == 1e-6
    assert cfg.actor.ppo_mini_batch_size == 16
    assert cfg.actor.max_tokens_per_micro_batch == 4 * (40 + 24)
    assert cfg.actor.clip_ratio_low == cfg.actor.clip_ratio_high == 0.3
    assert cfg.rollout.backend == "native" and cfg.rollout.n == 4 and cfg.rollout.top_k == -1
    assert cfg.rollout.max_new_tokens == 24
    assert cfg.algorithm.kl_coef == 0.01 and cfg.algorithm.kl_ctrl == "adaptive"
    assert cfg.reward.custom_function == "/r.py:compute_score"
    assert cfg.trainer.loggers == ["console", "jsonl"]
    assert cfg.trainer.total_steps == 0 and cfg.trainer.save_freq == 0
    assert cfg.trainer.output_dir == "/ckpt"
    assert cfg.actor.offload_params  # fsdp_config.param_offload=True
    assert any("fsdp_config.forward_prefetch ignored" in n for n in notes)
    assert any("actor.max_tokens_per_micro_batch=256" in n for n in notes)


def test_verl_objective_and_rollout_correction_keys_map():
    cfg, _ = _load(
        "grpo",
        [
            "actor_rollout_ref.actor.policy_loss.loss_mode=clip-cov",
            "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.01",
            "actor_rollout_ref.actor.policy_loss.clip_cov_lb=0.5",
            "actor_rollout_ref.actor.policy_loss.clip_cov_ub=4.0",
            "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.02",
            "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=0.5",
            "actor_rollout_ref.actor.tau_pos=1.5",
            "actor_rollout_ref.actor.tau_neg=2.0",
            "algorithm.rollout_correction.rollout_rs=geometric",
            "algorithm.rollout_correction.rollout_is_threshold=3.0",
            "algorithm.rollout_correction.rollout_rs_threshold=null",
            "algorithm.rollout_correction.rollout_rs_threshold_lower=null",
            "algorithm.rollout_correction.rollout_token_veto_threshold=1e-4",
        ],
    )
    actor, algo = cfg.actor, cfg.algorithm
    assert actor.policy_loss == "clip_cov"
    assert (actor.clip_cov_ratio, actor.clip_cov_lb, actor.clip_cov_ub) == (0.01, 0.5, 4.0)
    assert (actor.kl_cov_ratio, actor.kl_cov_coef) == (0.02, 0.5)
    assert (actor.tau_pos, actor.tau_neg) == (1.5, 2.0)
    # verl: a null upper end of the band is rollout_is_threshold; a null lower end 1 / upper.
    assert (algo.rollout_rs, algo.rollout_rs_threshold) == ("geometric", 3.0)
    assert algo.rollout_rs_threshold_lower == 0.0
    assert algo.rollout_token_veto_threshold == 1e-4
    for mode, name in [("geo_mean", "gmpo"), ("cispo", "cispo"), ("sapo", "sapo"), ("gpg", "gpg")]:
        cfg, _ = _load("grpo", [f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}"])
        assert cfg.actor.policy_loss == name
    cfg, _ = _load("grpo", ["algorithm.rollout_correction.rollout_rs=null"])
    assert cfg.algorithm.rollout_rs == "none"
    with pytest.raises(ConfigError, match="rollout_rs 'tokens'"):
        load_config("grpo", ["algorithm.rollout_correction.rollout_rs=tokens"])


def test_explicit_polyrl_option_wins_over_a_derived_one():
    cfg, notes = _load(
        "grpo",
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor.max_tokens_per_micro_batch=5000",
        ],
    )
    assert cfg.actor.max_tokens_per_micro_batch == 5000
    assert any("set explicitly" in n for n in notes)


def test_verl_reward_model_becomes_the_only_reward():
    given = ["reward_model.enable=True", "reward_model.model.path=/models/rm"]
    cfg, notes = _load("grpo", [*given, "reward_model.micro_batch_size_per_gpu=8"])
    assert cfg.reward.model_path == "/models/rm" and cfg.reward.rule_weight == 0.0
    assert cfg.reward.model_batch_size == 8
    assert any("reward.rule_weight=0.0" in n for n in notes)
    # verl's default config names a model.path it ignores while the reward model is disabled.
    cfg, _ = _load("grpo", ["reward_model.enable=False", "reward_model.model.path=/models/rm"])
    assert cfg.reward.model_path == "" and cfg.reward.rule_weight == 1.0
    cfg, _ = _load("grpo", [*given, "reward.rule_weight=0.5"])  # the polyrl option wins
    assert cfg.reward.model_path == "/models/rm" and cfg.reward.rule_weight == 0.5


def test_verl_lora_keys_set_the_lora_options():
    cfg, _ = _load(
        "grpo",
        [
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.lora_alpha=32",
            "actor_rollout_ref.model.target_modules=all-linear",
        ],
    )
    assert (cfg.model.lora_rank, cfg.model.lora_alpha) == (8, 32)
    assert cfg.model.target_modules == ["all-linear"]


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("actor_rollout_ref.actor.foo.bar=1", ["has no polyrl equivalent"]),
        ("critic.model.tokenizer_path=x", ["verl option 'critic.model.tokenizer_path'", "no"]),
        ("custom_reward_function.foo=1", ["has no polyrl equivalent"]),
        ("actor_rollout_ref.rollout.name=trtllm", ["'trtllm'", "vllm, sglang or hf"]),
        ("reward_model.enable=True", ["reward_model.enable", "needs reward_model.model.path"]),
        ("trainer.val_only=True", ["trainer.val_only", "no polyrl equivalent"]),
    ],
)
def test_verl_keys_without_a_polyrl_meaning_say_so(override, words):
    with pytest.raises(ConfigError) as info:
        load_config("grpo", [override])
    msg = str(info.value)
    for word in words:
        assert word in msg, msg
    assert "did you mean" not in msg


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("actor_rollout_ref.actor.optim.learning_rate=1e-6", "actor_rollout_ref.actor.optim.lr"),
        ("actor_rollout_ref.rollout.temprature=0.7", "actor_rollout_ref.rollout.temperature"),
        (
            "actor_rollout_ref.actor.ppo_mini_batchsize=16",
            "actor_rollout_ref.actor.ppo_mini_batch_size",
        ),
        ("actor_rollout_ref.model.pth=x", "actor_rollout_ref.model.path"),
    ],
)
def test_a_typo_of_a_verl_key_names_the_key(typo, meant):
    with pytest.raises(ConfigError) as info:
        load_config("grpo", [typo])
    assert f"did you mean '{meant}'?" in str(info.value)
    assert "no polyrl equivalent" not in str(info.value)


def test_no_suggestion_names_an_option_of_another_meaning():
    # Another word is another meaning: a generation batch is not the training batch (verl's
    # data.gen_batch_size maps onto DAPO's rounds), verl's micro-batch is not its mini-batch,
    # the low clip is not the high one.
    for bad in (
        "critic.model.tokenizer_path=x",
        "actor_rollout_ref.actor.ppo_micro_batch=2",
        "actor_rollout_ref.actor.clip_ratio_mid=0.2",
    ):
        with pytest.raises(ConfigError) as info:
            load_config("grpo", [bad])
        assert "did you mean" not in str(info.value), str(info.value)
    assert not verl_compat.near_spelling("gen_batch_size", "train_batch_size")
    assert not verl_compat.near_spelling("ppo_micro_batch_size", "ppo_mini_batch_size")
    assert verl_compat.near_spelling("learning_rate", "lr")


def test_speed_only_verl_knobs_are_accepted_with_a_note():
    ar = "actor_rollout_ref.rollout"
    line = [
        f"{ar}.multi_stage_wake_up=True",
        f"{ar}.over_sample_rate=0",
        f"{ar}.ignore_eos=False",
        "critic.optim.lr_warmup_steps_ratio=0",
    ]
    cfg, notes = _load("ppo", line)
    assert cfg == load_config("ppo", ["actor_rollout_ref.rollout.n=1"])
    assert any("multi_stage_wake_up ignored" in n for n in notes)
    # Away from the neutral value they change what is trained: refused, all in one error.
    with pytest.raises(ConfigError) as info:
        load_config("ppo", [f"{ar}.over_sample_rate=0.1", f"{ar}.ignore_eos=True"])
    assert "over_sample_rate=0.1" in str(info.value) and "ignore_eos=True" in str(info.value)


def test_every_problem_of_a_line_is_reported_at_once(capsys):
    from polyrl import cli

    line = [
        "actor_rollout_ref.rollout.temprature=0.7",
        "actor_rollout_ref.rollout.n=five",
        "trainer.val_only=True",
        "data.max_prompt_length=64",
        "nogroup.x=1",
    ]
    with pytest.raises(ConfigError) as info:
        load_config("grpo", line)
    msg = str(info.value)
    assert msg.startswith("4 problems in the overrides:")
    problems = msg.splitlines()[1:]
    assert len(problems) == 4, msg
    words = (
        "did you mean 'actor_rollout_ref.rollout.temperature'",
        "expected int",
        "trainer.val_only",
        "unknown key 'nogroup.x'",
    )
    for problem, word in zip(problems, words, strict=True):  # in the line's order
        assert word in problem, (word, msg)
    assert pickle.loads(pickle.dumps(info.value)).problems[3].source == "override 'nogroup.x=1'"
    assert cli.main(["config", "show", "grpo", *line]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "polyrl: error: 4 problems:" and len(err) == 5, err
    assert all(word in problem for problem, word in zip(err[1:], words, strict=True))


# ------------------------------------------------------------------ verl's defaults
def test_a_verl_line_takes_verls_defaults_with_one_note():
    line = ["actor_rollout_ref.model.path=/models/qwen", "trainer.project_name=p"]
    for preset, estimator in (("grpo", "grpo"), ("ppo", "gae"), (None, "grpo")):
        cfg, notes = _load(preset, line)
        assert cfg.algorithm.adv_estimator == estimator
        # verl's ppo_trainer.yaml, not the demo preset's values.
        assert cfg.actor.lr == 1e-6 and cfg.actor.ppo_epochs == 1
        assert cfg.actor.clip_ratio_low == cfg.actor.clip_ratio_high == 0.2
        assert cfg.actor.optim.weight_decay == 0.01 and cfg.actor.kl_loss_type == "low_var_kl"
        assert (cfg.algorithm.gamma, cfg.algorithm.lam) == (1.0, 1.0)
        assert (cfg.rollout.n, cfg.rollout.val_n, cfg.rollout.val_temperature) == (1, 1, 0.0)
        assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (512, 512)
        assert cfg.rollout.max_new_tokens == 512 and cfg.data.task == ""
        assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size) == (1024, 256)
        assert (cfg.trainer.total_steps, cfg.trainer.total_epochs) == (0, 30)
        assert cfg.trainer.resume_mode == "auto" and cfg.trainer.save_freq == 0
        assert cfg.trainer.output_dir == "checkpoints/p/gsm8k"
        assert len(notes) == 1 and "the line speaks verl" in notes[0], notes
    # The demo presets stay for lines in polyrl's own keys, and for a preset file.
    demo = load_config("grpo", ["model.path=/models/qwen"])
    assert demo.actor.lr == 3e-4 and demo.rollout.n == 8 and demo.data.task == "arithmetic"
    assert load_config("ppo", ["trainer.save_freq=-1"]).algorithm.lam == 0.95  # verl value
    preset_file = REPO / "polyrl" / "config" / "presets" / "grpo.yaml"
    assert load_config(preset_file, line).actor.lr == 3e-4
    # verl's defaults are its RL trainer's: an SFT preset keeps its values.
    sft, _ = _load("sft_demo", ["trainer.logger=console"])
    assert sft.sft == load_config("sft_demo").sft and sft.trainer.output_dir == "outputs/sft_demo"
    # A verl line's own values win over verl's defaults.
    cfg = load_config("grpo", [*line, "trainer.default_local_dir=/ckpt", "actor.lr=2e-6"])
    assert cfg.trainer.output_dir == "/ckpt" and cfg.actor.lr == 2e-6


def test_config_show_prints_verls_defaults(capsys):
    from polyrl import cli

    assert cli.main(["config", "show", "grpo", "actor_rollout_ref.rollout.n=5"]) == 0
    out = capsys.readouterr()
    shown = yaml.safe_load(out.out)
    assert shown["actor"]["optim"]["lr"] == 1e-6 and shown["rollout"]["n"] == 5
    assert shown["trainer"]["output_dir"] == "checkpoints/verl_examples/gsm8k"
    assert out.err.count("the line speaks verl") == 1


def test_a_verl_line_differs_from_verl_only_where_the_doc_says():
    from polyrl.config import available_presets
    from polyrl.config.loader import read_preset, to_dict

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict) and v:
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigNote)
        verl = flat(to_dict(load_config(None, ["trainer.logger=console"])))
    for key, value in verl_compat.VERL_DEFAULTS.items():
        assert verl[key] == value, key
    kept = verl_compat.PRESET_ALGORITHM_KEYS
    for preset in available_presets():
        data, _ = read_preset(preset)
        if "algorithm" not in data:
            continue  # not an RL preset
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigNote)
            got = flat(to_dict(load_config(preset, ["trainer.logger=console"])))
        differ = {k for k in got if got[k] != verl[k]}
        assert all(any(k == x or k.startswith(f"{x}.") for x in kept) for k in differ), (
            preset,
            differ,
        )
    doc = (REPO / "docs" / "migrating_from_verl.md").read_text()
    assert verl_compat.defaults_markdown() in doc, "regenerate: verl_compat.defaults_markdown()"


def test_list_options_take_verls_scalar_and_string_forms():
    for text in ["data.train_files=a.parquet", "data.train_files=\"['a.parquet']\""]:
        assert load_config(None, [text]).data.train_files == ["a.parquet"]
    cfg = load_config(None, ["data.val_files=\"['a.parquet', 'b.parquet']\""])
    assert cfg.data.val_files == ["a.parquet", "b.parquet"]
    assert load_config(None, ["rollout.stop_token_ids=7"]).rollout.stop_token_ids == [7]
    assert load_config(None, ["trainer.logger=console"]).trainer.loggers == ["console"]


def test_apply_overrides_reads_verl_keys_too():
    cfg = apply_overrides(PolyRLConfig(), ["actor_rollout_ref.actor.optim.lr=3e-6"])
    assert cfg.actor.lr == 3e-6


def test_every_alias_target_is_a_polyrl_option_and_the_doc_is_current():
    for entry in verl_compat.VERL_KEYS:
        if entry.kind in ("alias", "derived"):
            assert _is_schema_path(entry.polyrl.split("."), PolyRLConfig), entry
        if entry.kind != "alias" or entry.polyrl != entry.verl:
            # A verl key that is a polyrl key too must not mean something else here.
            assert not _is_schema_path(entry.verl.split("."), PolyRLConfig), entry
    doc = (REPO / "docs" / "migrating_from_verl.md").read_text()
    assert verl_compat.markdown_table() in doc, "regenerate: polyrl config verl"


def test_critic_model_path_without_model_path_is_refused():
    from polyrl.trainer.rl.checks import check_config

    cfg = load_config("grpo", ["critic.model_path=/models/qwen"])
    with pytest.raises(ConfigError, match=r"model.path: is empty.*critic.model_path"):
        check_config(cfg)
    check_config(cfg, has_model=True)


def test_apply_chat_template_kwargs_map_and_reach_the_dataset(tiny_qwen2_tokenizer, tmp_path):
    from polyrl.trainer.rl.build import load_datasets

    # verl's spellings: a YAML mapping, Hydra's {k:v}, one sub-key, and null (verl's default).
    for text in (
        "{enable_thinking: false}",
        "{enable_thinking:False}",
        "{}",
        "null",
    ):
        cfg = load_config("grpo", [f"data.apply_chat_template_kwargs={text}"])
        assert cfg.data.apply_chat_template_kwargs == (
            {"enable_thinking": False} if "thinking" in text else {}
        ), text
    cfg = load_config("grpo", ["data.apply_chat_template_kwargs.enable_thinking=false"])
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    for key in ("tokenize", "add_generation_prompt", "tools"):
        with pytest.raises(ConfigError, match=rf"data.apply_chat_template_kwargs: .*\['{key}'\]"):
            load_config(None, [f"data.apply_chat_template_kwargs={{{key}: true}}"])
    row = {"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}
    train, _ = load_datasets(cfg, tiny_qwen2_tokenizer, tmp_path, [row], custom_reward=True)
    assert train.apply_chat_template_kwargs == {"enable_thinking": False}


# ------------------------------------------------------------------ verl's DAPO keys
_DAPO_KEYS = [
    "actor_rollout_ref.rollout.n=4",  # verl's default is 1: no group could vary
    "data.train_batch_size=2",
    "data.gen_batch_size=3",
    "algorithm.filter_groups.enable=True",
    "algorithm.filter_groups.max_num_gen_batches=4",
]


@pytest.mark.parametrize(
    ("metric", "polyrl_metric"),
    [("acc", "acc"), ("score", "score"), ("seq_reward", "score"), ("seq_final_reward", "score")],
)
def test_verl_dapo_keys_set_dynamic_sampling(metric, polyrl_metric):
    cfg, _ = _load("dapo", [*_DAPO_KEYS, f"algorithm.filter_groups.metric={metric}"])
    algo = cfg.algorithm
    assert (algo.filter_groups, algo.filter_groups_metric) == (True, polyrl_metric)
    assert (algo.gen_batch_size, algo.max_gen_batches, cfg.data.train_batch_size) == (3, 4, 2)


def test_verl_seq_final_reward_with_kl_in_reward_is_refused():
    # verl's seq_final_reward sums the rewards less the KL penalty; polyrl applies that after
    # filtering, so the two would judge groups differently.
    with pytest.raises(ConfigError, match="seq_final_reward"):
        load_config(
            "dapo",
            ["algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=True"],
        )
    with pytest.raises(ConfigError, match="no polyrl equivalent"):
        load_config("dapo", ["algorithm.filter_groups.metric=seq_len"])
    with pytest.raises(ConfigError, match="no limit"):
        load_config("dapo", ["algorithm.filter_groups.max_num_gen_batches=0"])


def test_verls_seq_reward_is_the_score_polyrl_filters_on():
    """verl's seq_reward sums token_level_scores: the rule score plus the overlong penalty."""
    from polyrl.reward.shaping import overlong_penalty
    from polyrl.trainer.rl.advantage import place_on_last_token
    from polyrl.trainer.rl.rollout import group_varies

    # Cap 8, buffer 4, factor 1: a response of 8 tokens gets -1, of 6 tokens -0.5, of <= 4 none.
    lengths = torch.tensor([8, 4, 6, 2])
    rule = torch.tensor([1.0, 1.0, 0.0, 0.0])
    score = rule + overlong_penalty(lengths, 8, 4, 1.0)  # as RolloutProducer.score does
    assert score.tolist() == [0.0, 1.0, -0.5, 0.0]
    mask = torch.arange(8)[None, :] < lengths[:, None]
    assert place_on_last_token(score, mask).sum(-1).tolist() == score.tolist()
    # Both groups of two agree on acc and are dropped by it; their seq_reward differs.
    assert group_varies(rule, 2).tolist() == [False, False]
    assert group_varies(score, 2).tolist() == [True, True]


def test_gen_batch_size_rounds_fill_the_train_batch(tmp_path):
    """Rounds of gen_batch_size prompts until train_batch_size groups vary (verl's DAPO)."""
    from polyrl.core.columns import ACC, SCORE, UID
    from polyrl.trainer.rl.generation import DriverRollout, prompts_per_round

    cfg = load_config("dapo", [*_DAPO_KEYS, "algorithm.filter_groups.metric=seq_reward"])
    assert prompts_per_round(cfg) == 3
    n = cfg.rollout.n
    # Hand-made rewards per prompt: prompts 0 and 2 of round one vary, prompt 1 does not.
    rewards = {0: [1.0] + [0.0] * (n - 1), 1: [1.0] * n, 2: [0.0] * (n - 1) + [0.5]}

    class Producer:
        def sample_and_score(self, items, n_, temperature, seed, timing):
            rows = [rewards[i] for i in items]
            score = torch.tensor([r for row in rows for r in row])
            uids = np.array([f"p{i}" for i in items for _ in range(n_)], dtype=object)
            batch = Batch({SCORE: score, ACC: (score >= 1).float()}, {UID: uids})
            return batch, {}

    class Replicas:
        def sleep(self):
            pass

    drawn = []

    def next_indices():
        drawn.append([0, 1, 2])
        return drawn[-1]

    rollout = DriverRollout(cfg, Producer(), Replicas(), list(range(3)), next_indices)
    batch, metrics = rollout.generate(1, {})
    assert len(drawn) == 1 and metrics["filter/gen_batches"] == 1.0
    assert list(batch[UID][::n]) == ["p0", "p2"]  # train_batch_size groups, in order
    assert len(batch) == cfg.data.train_batch_size * n


def test_gen_batch_rounds_that_cannot_fill_the_batch_are_refused():
    from polyrl.trainer.rl.checks import check_config

    cfg = load_config("dapo", [*_DAPO_KEYS, "data.train_batch_size=16", "data.gen_batch_size=2"])
    with pytest.raises(ConfigError, match="algorithm.gen_batch_size"):
        check_config(cfg, has_rows=True, has_model=True)


# ------------------------------------------------------------------- verl's launch lines
# From verl's examples/grpo_trainer/run_qwen2-7b.sh and examples/ppo_trainer/
# run_deepseek7b_llm.sh; the values the test changes are in _SHRINK.
VERL_GRPO = """
    algorithm.adv_estimator=grpo
    data.train_files=$HOME/data/gsm8k/train.parquet
    data.val_files=$HOME/data/gsm8k/test.parquet
    data.train_batch_size=1024
    data.max_prompt_length=512
    data.max_response_length=1024
    data.filter_overlong_prompts=True
    data.truncation='error'
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger='["console","wandb"]'
    trainer.project_name='verl_grpo_example_gsm8k'
    trainer.experiment_name='qwen2_7b_function_rm'
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
"""

VERL_PPO = """
    algorithm.adv_estimator=gae
    data.train_files=$HOME/data/gsm8k/train.parquet
    data.val_files=$HOME/data/gsm8k/test.parquet
    data.train_batch_size=1024
    data.max_prompt_length=512
    data.max_response_length=512
    data.filter_overlong_prompts=True
    data.truncation='error'
    actor_rollout_ref.model.path=deepseek-ai/deepseek-llm-7b-chat
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
    actor_rollout_ref.rollout.tensor_model_parallel_size=4
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    critic.optim.lr=1e-5
    critic.model.use_remove_padding=True
    critic.model.path=deepseek-ai/deepseek-llm-7b-chat
    critic.model.enable_gradient_checkpointing=True
    critic.ppo_micro_batch_size_per_gpu=32
    critic.model.fsdp_config.param_offload=False
    critic.model.fsdp_config.optimizer_offload=False
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger='["console","wandb"]'
    trainer.project_name='verl_example_gsm8k'
    trainer.experiment_name='deepseek_llm_7b_function_rm'
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=1
    trainer.use_legacy_worker_impl=auto
    trainer.total_epochs=15
"""

# Shrunk to 2 steps of a nano model on CPU: 16 train prompts / 8 per batch, one epoch.
_SHRINK = {
    "data.train_batch_size": "8",
    "data.max_prompt_length": "64",
    "data.max_response_length": "8",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",
    "actor_rollout_ref.rollout.name": "hf",
    "actor_rollout_ref.rollout.n": "4",
    "trainer.logger": '\'["console","file"]\'',
    "trainer.n_gpus_per_node": "1",
    "trainer.save_freq": "-1",
    "trainer.test_freq": "2",
    "trainer.total_epochs": "1",
}


# tests/special_e2e/run_dapo.sh's line (recipe.dapo.main_dapo) as its shell expands it with
# NUM_GPUS=8, clip-higher, token-mean, the overlong buffer and dynamic sampling on seq_reward.
VERL_DAPO = """
    data.train_files=$HOME/data/gsm8k/train.parquet
    data.val_files=$HOME/data/gsm8k/test.parquet
    reward_model.reward_manager=dapo
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    algorithm.kl_ctrl.kl_coef=0.0
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.kl_loss_coef=0.0
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
    data.max_prompt_length=1024
    data.max_response_length=2048
    reward_model.overlong_buffer.enable=True
    reward_model.overlong_buffer.len=128
    reward_model.overlong_buffer.penalty_factor=1.0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    data.train_batch_size=256
    data.gen_batch_size=1024
    algorithm.filter_groups.enable=True
    algorithm.filter_groups.metric=seq_reward
    algorithm.filter_groups.max_num_gen_batches=10
    actor_rollout_ref.model.path=$HOME/models/Qwen/Qwen2.5-0.5B-Instruct
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.use_fused_kernels=True
    actor_rollout_ref.rollout.n=4
    actor_rollout_ref.actor.ppo_mini_batch_size=128
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.8
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    trainer.logger=console
    trainer.project_name='verl-test'
    trainer.experiment_name="qwen2.5-0.5b-instruct-dapo-minimal"
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.total_epochs=2
    trainer.resume_mode=disable
    trainer.val_before_train=False
    trainer.total_training_steps=1
"""

# The DAPO line's sizes, shrunk like _SHRINK's (its generation round stays 2x the train batch).
_SHRINK_DAPO = {
    **_SHRINK,
    "data.train_batch_size": "4",
    "data.gen_batch_size": "8",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
    "reward_model.overlong_buffer.len": "4",
    "trainer.total_training_steps": "2",
}


def _verl_args(
    script: str, model: Path, train: Any, test: Any, shrink: dict[str, str] | None = None
) -> list[str]:
    """The verl launch line's arguments as a shell would pass them, values shrunk."""
    paths = {
        "data.train_files": str(train),
        "data.val_files": str(test),
        "actor_rollout_ref.model.path": str(model),
        "critic.model.path": str(model),
    }
    shrink = {**_SHRINK, **(shrink or {})}
    args = []
    for line in script.split():
        key, _, value = line.partition("=")
        value = paths.get(key.lstrip("+"), shrink.get(key, value))
        # The shell strips one level of quotes: trainer.logger='["console"]' -> ["console"].
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        args.append(f"{key}={value}")
    return args


def _run_verl_line(
    tmp_path: Path,
    tiny_dir: Path,
    preset: str,
    script: str,
    files: tuple[Any, Any] | None = None,
    shrink: dict[str, str] | None = None,
) -> str:
    """Run ``polyrl train PRESET`` with the verl line; ``files`` replace the generated data."""
    if files is None:
        files = _task_files(tmp_path / "gsm8k", seed=0)
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return -len(solution_str) / 50.0\n"
    )
    args = _verl_args(script, tiny_dir, *files, shrink=shrink) + [
        f"custom_reward_function.path={reward}",
        f"trainer.default_local_dir={tmp_path / 'out'}",
        # The test machine: CPU, engines in local processes.
        "trainer.device=cpu",
        "trainer.worker_backend=local",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "train", preset, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _task_files(out: Path, seed: int, num_train: int = 16, prompt_key: str = "prompt"):
    """Tiny GSM8K-shaped parquet splits (the arithmetic task), prompts under ``prompt_key``."""
    from polyrl.data.io import read_rows, write_rows
    from polyrl.data.tasks import write_task_splits

    splits = write_task_splits("arithmetic", out, num_train, 8, seed=seed, max_digits=1)
    if prompt_key != "prompt":
        for path in splits:
            rows = read_rows(path)
            write_rows([{prompt_key: r.pop("prompt"), **r} for r in rows], path)
    return splits


def _summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "out" / "rl_summary.json").read_text())


@pytest.mark.slow
def test_verls_grpo_example_line_trains(tmp_path, tiny_qwen2_dir):
    started = time.perf_counter()
    out = _run_verl_line(tmp_path, tiny_qwen2_dir, "grpo", VERL_GRPO)
    # verl's defaults, not the demo preset's task and step count, fill what the line leaves.
    assert out.count("polyrl: note: the line speaks verl") == 1
    assert "dropped" not in out
    data_line = next(line for line in out.splitlines() if line.startswith("[rl] data:"))
    assert "train.parquet" in data_line and "16 train / 8 val prompts" in data_line
    assert "2 steps from trainer.total_epochs=1 x 2 batches of 8 prompts" in data_line
    summary = _summary(tmp_path)
    assert summary["steps"] == 2
    assert_policy_updated(tmp_path / "out", tiny_qwen2_dir, steps=2)
    cfg = load_config(tmp_path / "out" / "rl_config.yaml")
    assert cfg.model.path == str(tiny_qwen2_dir) and cfg.actor.use_kl_loss
    assert cfg.actor.kl_loss_type == "low_var_kl" and cfg.rollout.n == 4
    assert cfg.data.truncation == "filter" and cfg.trainer.loggers == ["console", "jsonl"]
    assert (tmp_path / "out" / "metrics.jsonl").is_file()
    print(f"verl GRPO line: {time.perf_counter() - started:.1f}s")


@pytest.mark.slow
def test_verls_ppo_example_line_trains(tmp_path, tiny_qwen2_dir):
    started = time.perf_counter()
    out = _run_verl_line(tmp_path, tiny_qwen2_dir, "ppo", VERL_PPO)
    assert "critic.ppo_micro_batch_size_per_gpu" in out  # named in the "ignored" note
    summary = _summary(tmp_path)
    assert summary["steps"] == 2
    assert_policy_updated(tmp_path / "out", tiny_qwen2_dir, steps=2)
    cfg = load_config(tmp_path / "out" / "rl_config.yaml")
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.model_path == str(tiny_qwen2_dir)
    assert cfg.critic.lr == 1e-5 and not cfg.algorithm.use_kl_in_reward
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any("critic/vf_loss" in r for r in records)
    print(f"verl PPO line: {time.perf_counter() - started:.1f}s")


@pytest.mark.slow
def test_verls_dapo_line_trains_with_dynamic_sampling(tmp_path, tiny_qwen2_dir):
    started = time.perf_counter()
    out = _run_verl_line(tmp_path, tiny_qwen2_dir, "dapo", VERL_DAPO, shrink=_SHRINK_DAPO)
    # Rounds of gen_batch_size prompts: an epoch of 16 prompts is two of them.
    assert "2 steps from trainer.total_steps (an epoch is 2)" in out
    assert _summary(tmp_path)["steps"] == 2
    assert_policy_updated(tmp_path / "out", tiny_qwen2_dir, steps=2)
    cfg = load_config(tmp_path / "out" / "rl_config.yaml")
    algo, actor = cfg.algorithm, cfg.actor
    # Each setting as verl means it (values shrunk by _SHRINK_DAPO).
    assert (algo.filter_groups, algo.gen_batch_size, algo.max_gen_batches) == (True, 8, 10)
    assert algo.filter_groups_metric == "score"  # seq_reward: the score, overlong penalty in
    assert cfg.data.train_batch_size == 4 and cfg.rollout.n == 4
    assert algo.adv_estimator == "grpo" and not algo.use_kl_in_reward and algo.kl_coef == 0.0
    assert not actor.use_kl_loss and actor.kl_loss_coef == 0.0
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.28)
    assert actor.loss_agg_mode == "token-mean" and actor.optim.lr == 1e-6
    assert actor.ppo_mini_batch_size == 2
    assert (cfg.reward.overlong_buffer_len, cfg.reward.overlong_penalty_factor) == (4, 1.0)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (64, 8)
    assert cfg.rollout.max_new_tokens == 8 and cfg.rollout.backend == "native"
    assert (cfg.trainer.total_steps, cfg.trainer.save_freq) == (2, 0)
    assert cfg.trainer.resume_mode == "never" and not cfg.trainer.val_before_train
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "filter/gen_batches" in r]
    assert len(steps) == 2
    for r in steps:
        # The dense reward scores responses by length: groups vary and one round fills the step.
        assert r["filter/gen_batches"] == 1.0 and r["filter/informative_groups"] == 4.0
    print(f"verl DAPO line: {time.perf_counter() - started:.1f}s")


# Our lines in the shape of verl's examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh
# (with verl's LoRA keys) and examples/ppo_trainer/run_qwen2-7b_seq_balance.sh (GSM8K + MATH in
# verl's string-list form); the values the tests change are in their shrink dicts.
VERL_GRPO_LORA = """
    algorithm.adv_estimator=grpo
    data.train_files=$HOME/data/gsm8k/train.parquet
    data.val_files=$HOME/data/gsm8k/test.parquet
    data.train_batch_size=1024
    data.max_prompt_length=512
    data.max_response_length=1024
    data.filter_overlong_prompts=True
    data.truncation='error'
    data.prompt_key=messages
    data.shuffle=False
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct
    actor_rollout_ref.model.use_shm=True
    actor_rollout_ref.model.lora_rank=64
    actor_rollout_ref.model.lora_alpha=32
    actor_rollout_ref.model.target_modules=all-linear
    actor_rollout_ref.actor.optim.lr=3e-6
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.rollout.load_format=safetensors
    actor_rollout_ref.rollout.layered_summon=True
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger=['console','wandb']
    trainer.project_name='verl_grpo_example_gsm8k'
    trainer.experiment_name='qwen2_7b_function_rm'
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
"""

VERL_PPO_SEQ_BALANCE = """
    data.train_files="$train_files"
    data.val_files="$test_files"
    data.train_batch_size=4096
    data.val_batch_size=1312
    data.max_prompt_length=4096
    data.max_response_length=4096
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.ppo_mini_batch_size=512
    actor_rollout_ref.actor.ppo_micro_batch_size=128
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.grad_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size=256
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5
    actor_rollout_ref.ref.log_prob_micro_batch_size=256
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    critic.optim.lr=1e-5
    critic.model.use_remove_padding=True
    critic.model.path=Qwen/Qwen2.5-Math-PRM-7B
    critic.model.enable_gradient_checkpointing=True
    critic.ppo_micro_batch_size=256
    critic.model.fsdp_config.param_offload=False
    critic.model.fsdp_config.grad_offload=False
    critic.model.fsdp_config.optimizer_offload=False
    algorithm.kl_ctrl.kl_coef=0.001
    trainer.critic_warmup=0
    trainer.logger=['console','wandb']
    trainer.project_name='verl_example_gsm8k'
    trainer.experiment_name='qwen2-7b_function_rm_bsz8k_p4k_r4k_seq_packing'
    trainer.n_gpus_per_node=8
    +trainer.val_before_train=False
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=5
    trainer.total_epochs=15
"""


def _resolved(tmp_path: Path) -> PolyRLConfig:
    """The run's resolved config (``rl_config.yaml`` shows every auto resolved)."""
    return load_config(tmp_path / "out" / "rl_config.yaml")


@pytest.mark.slow
def test_a_verl_grpo_lora_line_trains_with_verls_meaning(tmp_path, tiny_qwen2_dir):
    started = time.perf_counter()
    files = _task_files(tmp_path / "gsm8k", seed=0, prompt_key="messages")
    shrink = {"actor_rollout_ref.rollout.n": "5", "trainer.logger": "['console','file']"}
    out = _run_verl_line(tmp_path, tiny_qwen2_dir, "grpo", VERL_GRPO_LORA, files, shrink)
    assert out.count("polyrl: note: the line speaks verl") == 1
    assert _summary(tmp_path)["steps"] == 2
    cfg = _resolved(tmp_path)
    # What the line says, in verl's meaning.
    assert cfg.model.path == str(tiny_qwen2_dir) and cfg.actor.lr == 3e-6
    assert (cfg.model.lora_rank, cfg.model.lora_alpha) == (64, 32)
    assert cfg.model.target_modules == ["all-linear"]
    assert cfg.data.prompt_key == "messages" and not cfg.data.shuffle
    assert cfg.data.truncation == "filter" and cfg.data.train_files == [str(files[0])]
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (64, 8)
    assert cfg.rollout.max_new_tokens == 8 and cfg.rollout.n == 5
    assert cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef == 0.001
    assert cfg.actor.kl_loss_type == "low_var_kl" and cfg.actor.entropy_coeff == 0
    assert cfg.actor.gradient_checkpointing and not cfg.algorithm.use_kl_in_reward
    assert cfg.actor.ppo_mini_batch_size == 4 and cfg.trainer.test_freq == 2
    assert cfg.trainer.project_name == "verl_grpo_example_gsm8k"
    assert cfg.trainer.experiment_name == "qwen2_7b_function_rm"
    # What it leaves unset, at verl's defaults.
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std
    assert cfg.actor.clip_ratio_low == cfg.actor.clip_ratio_high == 0.2
    assert cfg.actor.ppo_epochs == 1 and cfg.actor.optim.weight_decay == 0.01
    assert (cfg.rollout.val_n, cfg.rollout.val_temperature) == (1, 0.0)
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k) == (1.0, 1.0, -1)
    assert cfg.trainer.resume_mode == "auto" and cfg.trainer.val_before_train
    print(f"verl GRPO LoRA line: {time.perf_counter() - started:.1f}s")


@pytest.mark.slow
def test_a_verl_ppo_line_on_two_train_files_trains_with_verls_meaning(tmp_path, tiny_qwen2_dir):
    started = time.perf_counter()
    gsm8k = _task_files(tmp_path / "gsm8k", seed=0, num_train=8)
    math = _task_files(tmp_path / "math", seed=1, num_train=8)
    # What the shell passes for data.train_files="['$gsm8k_train_path', '$math_train_path']".
    files = tuple(f"['{a}', '{b}']" for a, b in zip(gsm8k, math, strict=True))
    shrink = {
        "data.val_batch_size": "8",
        "actor_rollout_ref.actor.ppo_micro_batch_size": "2",
        "critic.ppo_micro_batch_size": "2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size": "2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size": "2",
        "trainer.logger": "['console','file']",
        "data.max_prompt_length": "64",
    }
    out = _run_verl_line(tmp_path, tiny_qwen2_dir, "ppo", VERL_PPO_SEQ_BALANCE, files, shrink)
    assert out.count("polyrl: note: the line speaks verl") == 1
    assert _summary(tmp_path)["steps"] == 2
    cfg = _resolved(tmp_path)
    assert cfg.data.train_files == [str(gsm8k[0]), str(math[0])]
    assert cfg.data.val_files == [str(gsm8k[1]), str(math[1])]
    assert cfg.critic.model_path == str(tiny_qwen2_dir) and cfg.critic.optim.lr == 1e-5
    assert cfg.actor.lr == 1e-6 and cfg.algorithm.kl_coef == 0.001
    assert cfg.actor.max_tokens_per_micro_batch == 16384  # ppo_max_token_len_per_gpu
    assert not cfg.trainer.val_before_train and cfg.data.val_batch_size == 8
    # What it leaves unset, at verl's defaults: GAE with lam 1, one response per prompt.
    assert cfg.algorithm.adv_estimator == "gae"
    assert (cfg.algorithm.gamma, cfg.algorithm.lam) == (1.0, 1.0)
    assert cfg.rollout.n == 1 and cfg.actor.ppo_epochs == cfg.critic.ppo_epochs == 1
    assert not cfg.algorithm.use_kl_in_reward and not cfg.actor.use_kl_loss
    assert cfg.critic.optim.weight_decay == 0.01 and cfg.critic.cliprange_value == 0.5
    assert cfg.actor.clip_ratio_low == cfg.actor.clip_ratio_high == 0.2
    assert (cfg.rollout.val_n, cfg.rollout.val_temperature) == (1, 0.0)
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any("critic/vf_loss" in r for r in records)
    print(f"verl PPO seq-balance line: {time.perf_counter() - started:.1f}s")


def test_hydra_add_and_force_prefixes_set_the_option():
    cfg = load_config(
        "grpo",
        [
            "+data.apply_chat_template_kwargs.enable_thinking=false",
            "++trainer.total_steps=3",
            "+actor_rollout_ref.rollout.n=4",  # a verl key, mapped as without the prefix
        ],
    )
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    assert (cfg.trainer.total_steps, cfg.rollout.n) == (3, 4)
    for bad in ("+++trainer.total_steps=3", "~trainer.total_steps"):
        with pytest.raises(ConfigError, match="malformed"):
            load_config("grpo", [bad])


def test_hydra_flow_mappings_read_for_every_mapping_option():
    # Hydra's {name:value} (no space) on any mapping option, not only the verl key.
    cfg = load_config("demo", ["data.task_options={max_digits:3,ops:'*'}"])
    assert cfg.data.task_options == {"max_digits": 3, "ops": "*"}


def test_the_readme_counts_the_verl_keys_read():
    import re

    text = (REPO / "README.md").read_text()
    count = re.search(r"the (\d+) keys read", text)
    assert count and int(count.group(1)) == len(verl_compat.VERL_KEYS), "update README's count"


def test_verl_ulysses_sizes_map_onto_the_actor_and_critic_engines():
    cfg, _ = _load(
        "grpo",
        [
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
            "critic.ulysses_sequence_parallel_size=4",
        ],
    )
    assert cfg.actor.ulysses_sequence_parallel_size == 2
    assert cfg.critic.ulysses_sequence_parallel_size == 4
    assert cfg.actor.tensor_parallel_size == cfg.actor.expert_parallel_size == 1


# verl's examples/grpo_trainer/run_qwen2_5_vl-7b.sh (Geometry3K with Qwen2.5-VL), as its shell
# expands it with ENGINE=vllm; the test swaps the model and the parquet files for local ones.
VERL_GEO3K = """
    algorithm.adv_estimator=grpo
    data.train_files=$HOME/data/geo3k/train.parquet
    data.val_files=$HOME/data/geo3k/test.parquet
    data.train_batch_size=512
    data.max_prompt_length=1024
    data.max_response_length=2048
    data.filter_overlong_prompts=True
    data.truncation='error'
    data.image_key=images
    actor_rollout_ref.model.path=Qwen/Qwen2.5-VL-7B-Instruct
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=128
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.01
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.enable_chunked_prefill=False
    actor_rollout_ref.rollout.enforce_eager=False
    actor_rollout_ref.rollout.free_cache_engine=False
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger=['console','wandb']
    trainer.project_name='verl_grpo_example_geo3k'
    trainer.experiment_name='qwen2_5_vl_7b_function_rm'
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
"""


@pytest.mark.slow
def test_verls_geometry3k_vlm_line_trains(tmp_path, tiny_vl_dir):
    from polyrl.data.tasks import write_task_splits

    # The visual task's parquet has verl's multi-modal layout: images: [{bytes}], "<image>"
    # in the prompt text, as geo3k's preprocessing writes it.
    files = write_task_splits("visual_count", tmp_path / "geo3k", 16, 8, seed=0)
    out = _run_verl_line(
        tmp_path,
        tiny_vl_dir,
        "grpo",
        VERL_GEO3K,
        files=files,
        shrink={"trainer.logger": "['console']", "data.max_prompt_length": "32"},
    )
    assert "dropped" not in out
    summary = _summary(tmp_path)
    assert summary["steps"] == 2
    cfg = load_config(tmp_path / "out" / "rl_config.yaml")
    assert cfg.data.image_key == "images" and cfg.model.path == str(tiny_vl_dir)
    assert cfg.actor.kl_loss_type == "low_var_kl" and cfg.rollout.n == 4


def test_verl_distillation_keys_map_onto_the_teacher_server_or_are_refused_by_name():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigNote)
        cfg = load_config(
            "grpo",
            [
                "distillation.enabled=true",
                "distillation.teacher_model.model_path=http://127.0.0.1:9",
                "distillation.distillation_loss.loss_mode=k1",
                "distillation.distillation_loss.distillation_loss_coef=0.5",
            ],
        )
        off = load_config("grpo", ["distillation.distillation_loss.distillation_loss_coef=0.5"])
    algo = cfg.algorithm
    assert (algo.distill_coef, algo.teacher_source) == (0.5, "server")
    assert algo.teacher_model_path == "http://127.0.0.1:9" and algo.teacher_topk == 0
    assert off.algorithm.distill_coef == 0.0  # not enabled: the coefficient alone turns nothing on
    for bad, words in (
        ("distillation.distillation_loss.loss_mode=forward_kl_topk", "forward_kl_topk"),
        ("distillation.distillation_loss.use_task_rewards=false", "use_task_rewards"),
        ("distillation.teacher_model.enable_resource_pool=true", "enable_resource_pool"),
    ):
        with pytest.raises(ConfigError, match=words):
            load_config("grpo", [bad])
