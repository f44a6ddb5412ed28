"""Typed configs, presets, overrides, YAML round-trips and the `polyrl config` CLI."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl import cli
from polyrl.config import (
    ConfigError,
    ConfigGroup,
    DataConfig,
    ModelConfig,
    PolyRLConfig,
    RolloutConfig,
    TrainerConfig,
    apply_overrides,
    available_presets,
    describe,
    from_dict,
    load_config,
    option,
    save_config,
    to_dict,
    to_yaml,
)

REPO = Path(__file__).resolve().parents[1]


def _groups(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """Every config dataclass reachable from ``cls`` with its dotted prefix."""
    found = [(prefix, cls)]
    instance = cls()
    for f in dataclasses.fields(cls):
        sub = getattr(instance, f.name)
        if dataclasses.is_dataclass(sub):
            found.extend(_groups(type(sub), f"{prefix}{f.name}."))
    return found


# --------------------------------------------------------------------------- schema


def test_every_option_of_every_group_has_help_and_a_valid_default():
    groups = _groups(PolyRLConfig)
    assert {cls.__name__ for _, cls in groups} >= {
        "PolyRLConfig",
        "ModelConfig",
        "DataConfig",
        "RewardConfig",
        "RolloutConfig",
        "TrainerConfig",
        "RayConfig",
    }
    for prefix, cls in groups:
        assert issubclass(cls, ConfigGroup), cls
        for f in dataclasses.fields(cls):
            help_text = f.metadata.get("help", "")
            assert isinstance(help_text, str) and help_text.strip(), f"{prefix}{f.name}"
            assert "\n" not in help_text, f"{prefix}{f.name} help must be one line"
            has_default = f.default is not dataclasses.MISSING
            assert has_default or f.default_factory is not dataclasses.MISSING
        cls()  # defaults pass validation


def test_describe_lists_every_leaf_option_once():
    rows = describe(PolyRLConfig)
    keys = [r.key for r in rows]
    assert len(keys) == len(set(keys))
    expected = {
        "seed",
        "model.path",
        "model.tiny_arch",
        "model.tiny_size",
        "model.dtype",
        "model.trust_remote_code",
        "data.task",
        "data.train_files",
        "data.val_files",
        "data.num_train",
        "data.num_val",
        "data.data_dir",
        "data.prompt_key",
        "data.max_prompt_length",
        "data.max_response_length",
        "data.train_batch_size",
        "data.val_batch_size",
        "data.truncation",
        "data.shuffle",
        "data.seed",
        "reward.custom_function",
        "reward.timeout_s",
        "reward.num_workers",
        "reward.error_reward",
        "rollout.n",
        "rollout.temperature",
        "rollout.top_p",
        "rollout.top_k",
        "rollout.min_p",
        "rollout.max_new_tokens",
        "rollout.repetition_penalty",
        "rollout.seed",
        "trainer.project_name",
        "trainer.experiment_name",
        "trainer.output_dir",
        "trainer.total_steps",
        "trainer.total_epochs",
        "trainer.loggers",
        "trainer.save_freq",
        "trainer.test_freq",
        "trainer.device",
        "trainer.resume",
        "ray.address",
        "ray.num_cpus",
        "ray.num_gpus",
        "ray.namespace",
    }
    assert expected <= set(keys)
    by_key = {r.key: r for r in rows}
    assert by_key["data.train_files"].type == "list[str]"
    assert by_key["data.train_files"].default == []
    assert by_key["trainer.total_steps"].type == "int"
    assert (
        by_key["model.tiny_arch"].type
        == "{qwen2,llama,qwen3,qwen3_moe,qwen2_vl,qwen2_5_vl,qwen3_vl,smolvlm}"
    )
    assert by_key["trainer.loggers"].type.startswith("list[{console,jsonl")
    assert by_key["model.trust_remote_code"].default is False
    assert all(r.help for r in rows)
    # An instance reports its own values.
    cfg = load_config("demo")
    assert {r.key: r.default for r in describe(cfg)}["data.task"] == cfg.data.task != ""


def test_mutable_defaults_are_not_shared():
    a, b = PolyRLConfig(), PolyRLConfig()
    a.trainer.loggers.append("jsonl")
    a.data.train_files.append("x.parquet")
    assert b.trainer.loggers == ["console"]
    assert b.data.train_files == []
    assert a.model is not b.model


@pytest.mark.parametrize(
    ("make", "key", "words"),
    [
        (lambda: ModelConfig(tiny_arch="gpt2"), "tiny_arch", ["'gpt2'", "qwen2", "qwen3_moe"]),
        (lambda: ModelConfig(dtype="fp8"), "dtype", ["'fp8'", "bfloat16"]),
        (lambda: DataConfig(truncation="middle"), "truncation", ["'middle'", "filter"]),
        (lambda: DataConfig(task="chess"), "task", ["'chess'", "countdown"]),
        (lambda: TrainerConfig(device="tpu"), "device", ["'tpu'", "cuda"]),
        (lambda: TrainerConfig(loggers=["console", "tb"]), "loggers", ["'tb'", "index 1"]),
        (lambda: TrainerConfig(total_steps="10"), "total_steps", ["expected int", "str"]),
        (lambda: TrainerConfig(resume=1), "resume", ["expected bool"]),
        (lambda: RolloutConfig(top_p=1.5), "top_p", ["1.5", "<= 1.0"]),
        (lambda: RolloutConfig(top_k=0), "top_k", ["-1"]),
        (lambda: DataConfig(train_batch_size=0), "train_batch_size", [">= 1"]),
    ],
)
def test_direct_construction_validates(make, key, words):
    with pytest.raises(ConfigError) as info:
        make()
    assert info.value.key == key
    for word in words:
        assert word in str(info.value)


def test_ints_for_float_options_become_floats():
    r = RolloutConfig(temperature=1)
    assert isinstance(r.temperature, float) and r.temperature == 1.0


def test_option_requires_help_and_one_default():
    with pytest.raises(TypeError, match="help"):
        option(1, "")
    with pytest.raises(TypeError, match="exactly one"):
        option(help="x")


def test_seed_for_falls_back_to_global_seed():
    cfg = load_config(overrides=["seed=7", "rollout.seed=3"])
    assert cfg.seed_for("data") == 7
    assert cfg.seed_for("rollout") == 3
    with pytest.raises(ConfigError, match="'model' has no seed"):
        cfg.seed_for("model")


# --------------------------------------------------------------------------- overrides


def test_overrides_scalars_nested_lists_bools():
    cfg = load_config(
        overrides=[
            "seed=3",
            "trainer.total_steps=12",
            "rollout.temperature=0.7",
            "rollout.top_k=50",
            "model.tiny_arch=llama",
            "data.shuffle=false",
            "model.trust_remote_code=true",
            "data.train_files=[a.parquet,b.parquet]",
            "trainer.loggers=[console,jsonl]",
            "ray.address=",
        ]
    )
    assert cfg.seed == 3
    assert cfg.trainer.total_steps == 12
    assert cfg.rollout.temperature == 0.7
    assert cfg.rollout.top_k == 50
    assert cfg.model.tiny_arch == "llama"
    assert cfg.data.shuffle is False
    assert cfg.model.trust_remote_code is True
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.trainer.loggers == ["console", "jsonl"]
    assert cfg.ray.address == ""
    # Untouched options keep their defaults.
    assert cfg.data.max_prompt_length == PolyRLConfig().data.max_prompt_length


def test_override_value_forms():
    base = PolyRLConfig()
    cfg = apply_overrides(
        base,
        [
            "rollout.temperature=1e-3",  # PyYAML reads this as text; floats accept it
            "reward.timeout_s=5",  # int for a float option
            "trainer.experiment_name=007",  # strings stay as typed
            "trainer.project_name=yes",
            "data.prompt_key=null",
            "trainer.output_dir=runs/a=b #1",
            "data.val_files=[]",
            "trainer.loggers=jsonl",  # a lone value is a one-element list
            "model={tiny_size: micro, dtype: bfloat16}",  # a mapping sets several options
        ],
    )
    assert cfg.rollout.temperature == pytest.approx(1e-3)
    assert cfg.reward.timeout_s == 5.0 and isinstance(cfg.reward.timeout_s, float)
    assert cfg.trainer.experiment_name == "007"
    assert cfg.trainer.project_name == "yes"
    assert cfg.data.prompt_key == "null"
    assert cfg.trainer.output_dir == "runs/a=b #1"
    assert cfg.data.val_files == []
    assert cfg.trainer.loggers == ["jsonl"]
    assert (cfg.model.tiny_size, cfg.model.dtype, cfg.model.tiny_arch) == (
        "micro",
        "bfloat16",
        "qwen2",
    )
    assert base == PolyRLConfig(), "apply_overrides must not modify its input"


def test_later_overrides_win_and_apply_over_the_preset():
    cfg = load_config("demo", ["trainer.total_steps=1", "trainer.total_steps=4"])
    assert cfg.trainer.total_steps == 4
    assert cfg.data.task != "" and cfg.data.task == load_config("demo").data.task


@pytest.mark.parametrize(
    ("override", "nearest"),
    [
        ("data.max_promt_length=3", "data.max_prompt_length"),
        ("modle.path=x", "model.path"),
        ("trainer.total_step=3", "trainer.total_steps"),
        ("rollout.temprature=0.5", "rollout.temperature"),
        ("sed=1", "seed"),
    ],
)
def test_unknown_override_key_names_nearest(override, nearest):
    bad = override.split("=")[0]
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    msg = str(info.value)
    assert f"unknown key '{bad}'" in msg
    assert f"did you mean '{nearest}'?" in msg
    assert override in msg


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("actor.learning_rate=1", ["'actor' has no option 'learning_rate'", "config describe"]),
        ("nogroup.x=1", ["unknown key 'nogroup.x'", "config describe"]),
    ],
)
def test_unknown_key_without_a_near_spelling_guesses_nothing(override, words):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    msg = str(info.value)
    assert "did you mean" not in msg  # 'actor.warmup_ratio' / 'rollout.n' were offered
    for word in words:
        assert word in msg


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("trainer.total_steps=abc", ["trainer.total_steps", "expected int", "'abc'"]),
        ("trainer.total_steps=1.5", ["trainer.total_steps", "expected int", "1.5"]),
        ("data.shuffle=maybe", ["data.shuffle", "expected bool", "'maybe'"]),
        ("rollout.top_p=high", ["rollout.top_p", "expected float", "'high'"]),
        ("data.train_files={a: 1}", ["data.train_files", "expected list[str]"]),
        ("data.train_files=", ["data.train_files", "[]"]),
        ("model=3", ["model", "mapping of ModelConfig options", "int 3"]),
        ("model.tiny_arch=gpt2", ["model.tiny_arch", "'gpt2'", "'qwen2', ", "qwen3_moe"]),
        ("trainer.loggers=[console,tb]", ["trainer.loggers", "'tb'", "jsonl"]),
        ("data.truncation=middle", ["data.truncation", "'middle'", "filter"]),
        ("rollout.n=0", ["rollout.n", ">= 1"]),
        ("data.prompt_key.x=1", ["'data.prompt_key' is an option of type str, not a group"]),
        ("data.train_files=[a", ["data.train_files", "cannot read the value as YAML"]),
        ("reward.custom_function=rewards.py", ["reward.custom_function", "file.py:function"]),
    ],
)
def test_bad_override_values_give_clear_errors(override, words):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    msg = str(info.value)
    for word in words:
        assert word in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("trainer.total_steps", ["malformed override", "key=value"]),
        ("=3", ["malformed key ''"]),
        ("trainer..total_steps=3", ["malformed key"]),
        ("+++trainer.total_steps=3", ["malformed key"]),  # +key and ++key are Hydra's forms
    ],
)
def test_malformed_overrides(override, words):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    for word in words:
        assert word in str(info.value)


def test_overrides_must_be_a_list():
    with pytest.raises(ConfigError, match="list of 'key=value'"):
        apply_overrides(PolyRLConfig(), "seed=1")


# --------------------------------------------------------------------------- presets and YAML


def test_bundled_presets():
    assert {"default", "demo", "grpo", "ppo"} <= set(available_presets())
    assert load_config() == PolyRLConfig()
    assert load_config("default") == PolyRLConfig()
    demo = load_config("demo")
    assert demo.model.path == ""
    assert (demo.model.tiny_arch, demo.model.tiny_size) == ("qwen2", "nano")
    assert demo.data.task in ("arithmetic", "string_reverse")
    assert demo.algorithm.adv_estimator == "grpo"
    # A CPU demo of a few minutes: a short SFT warm-up, then a bounded number of RL steps.
    assert 0 < demo.sft.total_steps <= 2000
    assert 0 < demo.trainer.total_steps <= 200
    assert demo.trainer.device == "cpu"
    assert load_config("ppo").algorithm.adv_estimator == "gae"
    assert load_config("grpo").algorithm.adv_estimator == "grpo"


def test_partial_yaml_file_keeps_other_defaults(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("trainer:\n  total_steps: 9\ndata:\n  train_files: [x.parquet]\n")
    for preset in (path, str(path)):
        cfg = load_config(preset)
        assert cfg.trainer.total_steps == 9
        assert cfg.data.train_files == ["x.parquet"]
        assert cfg.trainer.loggers == PolyRLConfig().trainer.loggers
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert load_config(empty) == PolyRLConfig()


def test_unknown_key_in_yaml_names_nearest_and_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("data:\n  max_promt_length: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert "unknown key 'data.max_promt_length'" in msg
    assert "did you mean 'data.max_prompt_length'?" in msg
    assert str(path) in msg

    path.write_text("trainr:\n  total_steps: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'trainer'"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("trainer:\n  total_steps: abc\n", ["trainer.total_steps", "expected int", "'abc'"]),
        ("model:\n  tiny_arch: gpt2\n", ["model.tiny_arch", "'gpt2'", "llama"]),
        ("model: qwen2\n", ["model", "mapping of ModelConfig options"]),
        ("- a\n- b\n", ["mapping of options at the top level", "list"]),
        ("model:\n  path: a\n  path: b\n", ["duplicate key 'path'", "line 3"]),
        ("model: [\n", ["invalid YAML"]),
        ("1: x\n", ["option names must be strings"]),
    ],
)
def test_bad_yaml_files(tmp_path, text, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    for word in words:
        assert word in msg, msg
    assert str(path) in msg


def test_unknown_preset_lists_available(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config("no_such_preset")
    msg = str(info.value)
    assert "unknown preset 'no_such_preset'" in msg
    for name in available_presets():
        assert name in msg
    with pytest.raises(ConfigError, match="preset file not found"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_round_trip(tmp_path):
    cfg = load_config(
        "demo",
        [
            "data.train_files=[a.parquet,b.parquet]",
            "trainer.experiment_name=007",
            "trainer.project_name=yes",
            "rollout.temperature=1e-7",
            "model.path=/models/x: y",
            "trainer.loggers=[console,jsonl,tensorboard]",
            "reward.custom_function=my rewards.py:score",
        ],
    )
    path = save_config(cfg, tmp_path / "nested" / "cfg.yaml")
    assert path.is_file()
    assert load_config(path) == cfg
    assert from_dict(yaml.safe_load(to_yaml(cfg))) == cfg
    assert to_dict(cfg)["data"]["train_files"] == ["a.parquet", "b.parquet"]


_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20)


@settings(max_examples=30, deadline=None)
@given(
    name=_text.filter(str.strip),
    files=st.lists(_text, max_size=3),
    steps=st.integers(0, 10**9),
    temperature=st.floats(0.0, 100.0, allow_nan=False),
    top_p=st.floats(1e-6, 1.0),
    shuffle=st.booleans(),
    error_reward=st.floats(-1e6, 1e6, allow_nan=False),
)
def test_yaml_round_trip_property(name, files, steps, temperature, top_p, shuffle, error_reward):
    cfg = from_dict(
        {
            "trainer": {"experiment_name": name, "total_steps": steps},
            "data": {"train_files": files, "shuffle": shuffle},
            "rollout": {"temperature": temperature, "top_p": top_p},
            "reward": {"error_reward": error_reward},
        }
    )
    assert from_dict(yaml.safe_load(to_yaml(cfg))) == cfg


@settings(max_examples=30, deadline=None)
@given(text=_text.filter(str.strip))
def test_string_overrides_are_taken_verbatim(text):
    cfg = apply_overrides(PolyRLConfig(), [f"trainer.experiment_name={text}"])
    assert cfg.trainer.experiment_name == text


# --------------------------------------------------------------------------- extending


@dataclasses.dataclass
class _EngineConfig(ConfigGroup):
    """A group a later issue might add."""

    lr: float = option(1e-6, "Learning rate.", gt=0.0)
    kwargs: dict[str, Any] = option({}, "Free-form engine arguments.")
    backend: str | None = option(None, "Backend name; null picks one.")


@dataclasses.dataclass
class _ExtendedConfig(PolyRLConfig):
    engine: _EngineConfig = option(_EngineConfig, "Model engine.")


def test_adding_a_group_is_a_dataclass_and_a_field():
    cfg = from_dict({"engine": {"lr": 0.5}, "trainer": {"total_steps": 2}}, _ExtendedConfig)
    assert cfg.engine.lr == 0.5 and cfg.trainer.total_steps == 2
    cfg = apply_overrides(
        cfg,
        [
            "engine.kwargs.fsdp.shard=4",
            "engine.kwargs.name=x",
            "engine.backend=fsdp2",
            "engine.lr=1e-4",
        ],
    )
    assert cfg.engine.kwargs == {"fsdp": {"shard": 4}, "name": "x"}
    assert cfg.engine.backend == "fsdp2"
    assert apply_overrides(cfg, ["engine.backend=null"]).engine.backend is None
    assert from_dict(yaml.safe_load(to_yaml(cfg)), _ExtendedConfig) == cfg
    assert "engine.kwargs" in {r.key for r in describe(_ExtendedConfig)}
    with pytest.raises(ConfigError, match="did you mean 'engine.lr'"):
        apply_overrides(cfg, ["engine.lrr=1"])
    with pytest.raises(ConfigError, match="engine.lr: value 0.0 out of range"):
        apply_overrides(cfg, ["engine.lr=0"])


# --------------------------------------------------------------------------- CLI


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = REPO / ".venv" / "bin" / "polyrl"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "polyrl.cli"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=60, env=env, cwd=REPO
    )


def test_cli_show_demo_subprocess_round_trips():
    proc = _run_cli("config", "show", "demo", "trainer.total_steps=7", "data.train_files=[a,b]")
    assert proc.returncode == 0, proc.stderr
    expected = load_config("demo", ["trainer.total_steps=7", "data.train_files=[a,b]"])
    assert from_dict(yaml.safe_load(proc.stdout)) == expected
    assert expected.trainer.total_steps == 7


def test_cli_module_entry_and_unknown_key_error():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "config", "show", "demo", "data.max_promt_length=1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "did you mean 'data.max_prompt_length'?" in lines[0]


def test_cli_show_file_and_overrides_in_process(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  total_steps: 5\n")
    assert cli.main(["config", "show", str(path), "seed=9"]) == 0
    shown = from_dict(yaml.safe_load(capsys.readouterr().out))
    assert shown == load_config(path, ["seed=9"])
    assert cli.main(["config", "show"]) == 0
    assert from_dict(yaml.safe_load(capsys.readouterr().out)) == PolyRLConfig()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["config", "show", "nope"], ["unknown preset 'nope'", "default", "demo"]),
        (["config", "show", "demo", "trainer.total_steps=abc"], ["expected int"]),
        (["config", "show", "demo", "oops"], ["malformed override 'oops'"]),
        (["config", "show", "demo", "modle.path=x"], ["did you mean 'model.path'?"]),
        (["config"], ["required"]),
        (["frobnicate"], ["invalid choice"]),
        ([], ["required"]),
    ],
)
def test_cli_errors_exit_2_with_one_line(capsys, argv, words):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("polyrl: error: ")
    for word in words:
        assert word in lines[0]


def test_cli_describe_lists_every_option(capsys):
    assert cli.main(["config", "describe"]) == 0
    out = capsys.readouterr().out
    for row in describe(PolyRLConfig):
        assert f"{row.key}: {row.type} = " in out
        assert row.help in out
    assert cli.main(["config", "describe", "--format", "markdown"]) == 0
    md = capsys.readouterr().out.splitlines()
    assert md[0].startswith("| option | type | default | description |")
    assert len(md) == 2 + len(describe(PolyRLConfig))
    assert cli.main(["config", "presets"]) == 0
    assert capsys.readouterr().out.split() == available_presets()


def test_cli_help_and_version(capsys):
    assert cli.main(["--help"]) == 0
    assert "config" in capsys.readouterr().out
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("polyrl ")


@pytest.fixture
def drop_steps_command():
    yield
    cli._COMMANDS.remove("steps")


def test_subcommand_registry(drop_steps_command, capsys):
    @cli.subcommand("steps", help="Print the configured step count.")
    def _setup(parser: argparse.ArgumentParser) -> cli.Handler:
        cli.add_config_arguments(parser)
        parser.add_argument("--twice", action="store_true")

        def run(args: argparse.Namespace) -> int:
            cfg = cli.config_from_args(args)
            print(cfg.trainer.total_steps * (2 if args.twice else 1))
            return 3

        return run

    assert cli.main(["steps", "demo", "trainer.total_steps=4", "--twice"]) == 3
    assert capsys.readouterr().out.strip() == "8"
    assert cli.main(["steps", "trainer.total_steps=5"]) == 3
    assert capsys.readouterr().out.strip() == "5"
    with pytest.raises(ValueError, match="already registered"):
        cli.subcommand("steps", help="again")(_setup)


@dataclasses.dataclass
class _WithOptional(ConfigGroup):
    """A root with an optional group and a union option."""

    engine: _EngineConfig | None = option(None, "Optional engine group.")
    size: int | str = option(1, "A number or a size name.")


def test_optional_groups_and_unions():
    cfg = apply_overrides(_WithOptional(), ["engine.lr=0.25", "size=3"])
    assert cfg.engine == _EngineConfig(lr=0.25)
    assert cfg.size == 3
    assert apply_overrides(cfg, ["size=big"]).size == "big"
    assert apply_overrides(cfg, ["engine=null"]).engine is None
    with pytest.raises(ConfigError, match="unknown key 'engine.lrr'; did you mean 'engine.lr'"):
        apply_overrides(_WithOptional(), ["engine.lrr=1"])
    with pytest.raises(ConfigError, match=re.escape("size: expected int | str, got a list")):
        apply_overrides(cfg, ["size=[1]"])


def test_config_error_survives_pickling():
    import pickle

    with pytest.raises(ConfigError) as info:
        load_config(overrides=["trainer.total_steps=abc"])
    copy = pickle.loads(pickle.dumps(info.value))
    assert (copy.key, copy.detail, copy.source) == (
        info.value.key,
        info.value.detail,
        info.value.source,
    )
    assert copy.key == "trainer.total_steps"
    assert str(copy) == str(info.value)


def test_constructor_kwargs_maps_sections_onto_a_constructor_by_field_name():
    import dataclasses

    from polyrl.config.schema import constructor_kwargs

    @dataclasses.dataclass
    class Target:
        lr: float = 0.0
        grad_clip: float = 0.0
        name: str = ""
        scheduler: str = ""

    cfg = load_config(
        "ppo", ["actor.optim.lr=0.25", "actor.optim.grad_clip=2.0", "critic.optim.grad_clip=3.0"]
    )
    # optim.optimizer and optim.lr_scheduler map onto name and scheduler (option(maps_to=)).
    assert constructor_kwargs(Target, cfg.actor.optim) == {
        "lr": 0.25,
        "grad_clip": 2.0,
        "name": "adamw",
        "scheduler": "constant",
    }
    # Later sections win; explicit values win over both.
    got = constructor_kwargs(Target, cfg.actor.optim, cfg.critic.optim, name="sgd")
    assert got["grad_clip"] == 3.0 and got["name"] == "sgd" and got["lr"] == cfg.critic.optim.lr
    with pytest.raises(TypeError, match="no field"):
        constructor_kwargs(Target, cfg.actor.optim, momentum=0.9)


def test_rl_engine_specs_take_each_option_from_its_section(tmp_path):
    from polyrl.trainer.rl.build import engine_specs

    cfg = load_config(
        "ppo",
        [
            "actor.optim.grad_clip=2.5",
            "actor.share_prefix=true",
            "actor.optim.lr=3e-6",
            "actor.optim.warmup_ratio=0.1",
            "critic.optim.grad_clip=0.5",
            "critic.optim.lr=2e-5",
            "trainer.max_ckpt_to_keep=1",
        ],
    )
    specs = engine_specs(cfg, tmp_path, total_steps=7, use_ref=True, use_critic=True)
    actor, critic, ref = (specs[k].kwargs for k in ("actor", "critic", "ref"))
    assert actor["engine"].grad_clip == 2.5 and actor["engine"].share_prefix is True
    assert actor["optimizer"].lr == 3e-6 and actor["optimizer"].warmup_ratio == 0.1
    assert actor["optimizer"].total_steps == 7
    assert critic["engine"].grad_clip == 0.5 and critic["engine"].share_prefix is True
    assert critic["optimizer"].lr == 2e-5 and critic["optimizer"].scheduler == "constant"
    assert ref["engine"] is actor["engine"]
    assert actor["model"].path == str(tmp_path) and critic["model"].kind == "value"
    # Only the actor prunes itself: a critic saved (and pruned) before a crash in the actor's
    # save would lose the step the run resumes from; the trainer prunes it after the actor.
    assert actor["checkpoint"].max_to_keep == 1 and critic["checkpoint"].max_to_keep == 0


def test_optim_groups_keep_their_owners_defaults():
    cfg = PolyRLConfig()
    assert (cfg.actor.optim.lr, cfg.critic.optim.lr, cfg.prime.optim.lr) == (1e-6, 1e-5, 1e-6)
    assert (cfg.sft.optim.lr, cfg.dpo.optim.lr, cfg.rm.optim.lr) == (1e-5, 1e-6, 1e-5)
    assert cfg.prime.optim.grad_clip == 10.0 and cfg.sft.optim.weight_decay == 0.01
    assert cfg.sft.optim.lr_scheduler == "cosine" and cfg.dpo.optim.lr_scheduler == "linear"
    # Setting one option of an owner's optim keeps that owner's other defaults.
    assert PolyRLConfig(critic={"optim": {"grad_clip": 2.0}}).critic.optim.lr == 1e-5
    assert load_config(None, ["critic.optim.grad_clip=2"]).critic.optim.lr == 1e-5


def test_flat_optimizer_spellings_are_aliases_of_the_optim_group(tmp_path):
    canonical = load_config("ppo", ["actor.optim.lr=0.25", "critic.optim.grad_clip=3.0"])
    # Overrides, YAML files, Python mappings and attributes take the flat spelling.
    assert load_config("ppo", ["actor.lr=0.25", "critic.grad_clip=3.0"]) == canonical
    preset = tmp_path / "flat.yaml"
    preset.write_text("actor:\n  lr: 0.25\ncritic:\n  grad_clip: 3.0\n  lr: 0.001\n")
    flat = load_config(str(preset), ["critic.cliprange_value=0.5", "actor.ppo_epochs=2"])
    assert flat.actor.optim.lr == 0.25 and flat.critic.optim.grad_clip == 3.0
    cfg = PolyRLConfig(sft={"lr": 0.5, "optim": {"weight_decay": 0.0}})
    assert (cfg.sft.optim.lr, cfg.sft.optim.weight_decay, cfg.sft.lr) == (0.5, 0.0, 0.5)
    cfg.sft.lr_scheduler = "linear"
    assert cfg.sft.optim.lr_scheduler == "linear"
    # A later key wins over an earlier one that sets the same option.
    assert load_config(None, ["actor.lr=0.1", "actor.optim.lr=0.2"]).actor.optim.lr == 0.2
    assert load_config(None, ["actor.optim.lr=0.2", "actor.lr=0.1"]).actor.optim.lr == 0.1
    # A near miss of an alias is suggested like an option.
    with pytest.raises(ConfigError, match="did you mean 'actor.lr'"):
        load_config(None, ["actor.lrr=1"])
    # The dump holds the canonical spelling only, and reads back the same.
    assert "optim:" in to_yaml(canonical) and "\n  lr:" not in to_yaml(canonical)
    (tmp_path / "dump.yaml").write_text(to_yaml(canonical))
    assert load_config(str(tmp_path / "dump.yaml")) == canonical


def test_replica_options_map_the_rollout_group_onto_the_backend_options():
    from polyrl.rollout.native.engine import NativeEngineConfig
    from polyrl.trainer.rl.build import replica_options

    cfg = load_config(
        "demo", ["trainer.device=cpu", "rollout.max_num_seqs=7", "rollout.num_threads=1"]
    )
    options = replica_options(cfg)
    assert options == {
        "dtype": cfg.model.dtype,
        "device": "cpu",
        "seed": cfg.seed_for("rollout"),
        "max_num_seqs": 7,
        "num_threads": 1,
        "enable_prefix_caching": True,
    }
    NativeEngineConfig(**options)  # every key is an option of the native backend
    bf16 = replica_options(
        load_config("demo", ["trainer.device=cpu", "model.compute_dtype=bfloat16"])
    )
    assert bf16["matmul_dtype"] == "bfloat16" and "num_threads" not in bf16
    # vLLM's image processor is started with the trainer's pixel bounds; the native server
    # gets them with each prompt.
    from polyrl.rollout.vllm_backend import VLLMOptions

    bounds = ["trainer.device=cpu", "data.image_max_pixels=3136"]
    vllm = replica_options(load_config("demo", [*bounds, "rollout.backend=vllm"]))
    assert vllm["image_max_pixels"] == 3136 and "image_min_pixels" not in vllm
    VLLMOptions(**vllm)
    assert "image_max_pixels" not in replica_options(load_config("demo", bounds))


@pytest.mark.parametrize(
    ("trainer", "rollout", "same_host", "same_gpu", "expected"),
    [
        ("cuda", "cuda", True, True, ("cuda_ipc", {})),
        ("cuda", "cuda", True, False, ("dist", {"backend": "nccl"})),
        ("cuda", "cuda", False, False, ("dist", {"backend": "nccl"})),
        ("cpu", "cpu", True, False, ("shm", {})),
        ("cuda", "cpu", True, False, ("shm", {})),
        ("cpu", "cpu", False, False, ("dist", {"backend": "gloo"})),
        ("cuda", "cpu", False, False, ("dist", {"backend": "gloo"})),
    ],
)
def test_auto_weight_transport_follows_the_placement(
    trainer, rollout, same_host, same_gpu, expected
):
    from polyrl.trainer.rl.build import choose_transport

    assert choose_transport(trainer, rollout, same_host, same_gpu) == expected


def test_choose_transport_refuses_an_unknown_device():
    from polyrl.trainer.rl.build import choose_transport

    with pytest.raises(ValueError, match="rollout device"):
        choose_transport("cpu", "tpu", True)
