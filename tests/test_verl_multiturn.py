"""verl's multi-turn tool scripts as ``polyrl train``: ``--config-path/--config-name`` with a verl
base YAML, ``multi_turn.tool_config_path`` (verl's tool YAML) and ``multi_turn.enable``."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import warnings
from pathlib import Path

import pytest

from polyrl.cli import main
from polyrl.config import ConfigError, ConfigNote, PolyRLConfig, load_config
from polyrl.config.loader import verl_config_overrides

MT = "actor_rollout_ref.rollout.multi_turn"

# verl's examples/sglang_multiturn/config/gsm8k_multiturn_grpo.yaml, in its shape.
VERL_BASE = """\
hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - ppo_trainer
  - _self_

data:
  max_prompt_length: {prompt}
  max_response_length: {response}
  train_batch_size: {batch}
  return_raw_chat: True

actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_assistant_turns: 5
"""

# verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml.
VERL_TOOLS = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is \\
          correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""


def _write_configs(root: Path, prompt: int = 1024, response: int = 1024, batch: int = 256):
    config = root / "config"
    (config / "tool_config").mkdir(parents=True)
    (config / "gsm8k_multiturn_grpo.yaml").write_text(
        VERL_BASE.format(prompt=prompt, response=response, batch=batch)
    )
    tools = config / "tool_config" / "gsm8k_tool_config.yaml"
    tools.write_text(VERL_TOOLS)
    return config, tools


def _load(preset: str | None, overrides: list[str]) -> tuple[PolyRLConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigNote)
        cfg = load_config(preset, overrides)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigNote)]


# ------------------------------------------------------------------ the verl base YAML
def test_verl_base_yaml_reads_as_verl_keys_and_the_line_wins(tmp_path):
    config, tools = _write_configs(tmp_path)
    base, notes = verl_config_overrides(config, "gsm8k_multiturn_grpo")
    assert any("'hydra:' section is ignored" in n for n in notes)
    assert "data.max_response_length=1024" in base and f"{MT}.enable=true" in base
    cfg, notes = _load(
        "grpo",
        [*base, "data.max_response_length=512", f"{MT}.tool_config_path={tools}"],
    )
    assert cfg.data.max_prompt_length == 1024 and cfg.data.train_batch_size == 256
    assert cfg.data.max_response_length == 512  # the command line wins
    assert cfg.rollout.backend == "sglang" and cfg.agent.max_turns == 5
    assert cfg.agent.enable and cfg.agent.default_loop == "tool"
    assert cfg.agent.tool_config == str(tools) and cfg.agent.tools == []
    # verl's multi-turn turn runs to the response budget, not the preset's 16 tokens (a verl
    # line's unset options are verl's defaults, so the budget is already the response length).
    assert cfg.rollout.max_new_tokens == 512


def test_verl_base_yaml_defaults_take_files_of_the_folder_and_refuse_others(tmp_path):
    (tmp_path / "common.yaml").write_text("data:\n  train_batch_size: 8\n  max_prompt_length: 9\n")
    (tmp_path / "run.yaml").write_text(
        "defaults:\n  - ppo_trainer\n  - common\n  - _self_\ndata:\n  max_prompt_length: 99\n"
    )
    base, _ = verl_config_overrides(tmp_path, "run")
    cfg, _ = _load("grpo", base)
    assert cfg.data.train_batch_size == 8 and cfg.data.max_prompt_length == 99
    (tmp_path / "other.yaml").write_text("defaults:\n  - ppo_megatron_trainer\n")
    with pytest.raises(ConfigError, match="ppo_megatron_trainer"):
        verl_config_overrides(tmp_path, "other")
    with pytest.raises(ConfigError, match="not found"):
        verl_config_overrides(tmp_path, "missing")


@pytest.mark.parametrize(
    ("path_flags", "name_flags"),
    [
        (["--config-path={d}"], ["--config-name=gsm8k_multiturn_grpo"]),
        (["--config-path", "{d}"], ["--config-name", "gsm8k_multiturn_grpo"]),
        (["-cp", "{d}"], ["-cn", "gsm8k_multiturn_grpo"]),
    ],
)
def test_config_show_takes_hydras_config_flags_anywhere(tmp_path, capsys, path_flags, name_flags):
    config, _ = _write_configs(tmp_path)
    path_flags = [f.format(d=config) for f in path_flags]
    code = main(["config", "show", "grpo", *path_flags, "data.max_prompt_length=77", *name_flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "max_prompt_length: 77" in out and "max_response_length: 1024" in out
    assert "'hydra:' section is ignored" in err


def test_config_path_without_config_name_is_one_line(capsys):
    assert main(["config", "show", "grpo", "--config-path=/nowhere"]) == 2
    assert "--config-path needs --config-name" in capsys.readouterr().err


def test_a_bad_key_of_the_verl_yaml_names_the_yaml(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("data:\n  max_prompt_lenght: 5\n")
    assert main(["config", "show", "grpo", "-cp", str(tmp_path), "-cn", "run"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'data.max_prompt_length'" in err
    assert "read from --config-name run" in err


# ------------------------------------------------------------------ verl's tool YAML
def test_verls_gsm8k_tool_becomes_polyrls_answer_check_with_the_given_schema(tmp_path):
    from polyrl.agent.tools import Gsm8kCheckTool, load_tool_config

    _, path = _write_configs(tmp_path)
    (tool,) = load_tool_config(path)
    assert isinstance(tool, Gsm8kCheckTool) and tool.name == "calc_gsm8k_reward"
    assert tool.schema()["function"]["parameters"]["required"] == ["answer"]
    ctx = {"create_kwargs": {"ground_truth": "72"}}  # verl's tools_kwargs layout
    assert asyncio.run(tool.call({"answer": "72"}, **ctx)).endswith("reward=1.0")
    assert asyncio.run(tool.call({"answer": "#### 7"}, ground_truth="72")).endswith("reward=0.0")


def test_a_tool_class_is_imported_by_path_and_must_be_a_polyrl_tool(tmp_path):
    from polyrl.agent.tools import CalculatorTool, load_tool_config

    ok = tmp_path / "ok.yaml"
    ok.write_text(
        "tools:\n  - class_name: polyrl.agent.tools.CalculatorTool\n    config: {type: native}\n"
    )
    (tool,) = load_tool_config(ok)
    assert isinstance(tool, CalculatorTool) and tool.name == "calculator"
    for cls, words in [
        ("verl.tools.search_tool.SearchTool", "has no polyrl equivalent"),
        ("json.JSONDecoder", "is not a polyrl tool"),
        ("nowhere.Tool", "cannot import tool class 'nowhere.Tool'"),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(f"tools:\n  - class_name: {cls}\n")
        with pytest.raises(ConfigError, match=words):
            load_config("grpo", [f"{MT}.tool_config_path={bad}"])


def test_multi_turn_keys_verl_lacks_are_refused_or_noted():
    cfg, notes = _load("grpo", [f"{MT}.max_parallel_calls=1", f"{MT}.format=hermes"])
    assert not cfg.agent.enable and cfg.agent.tool_parser == "hermes"
    assert any("max_parallel_calls ignored" in n for n in notes)
    with pytest.raises(ConfigError, match="max_user_turns"):
        load_config("grpo", [f"{MT}.max_user_turns=3"])
    # Off, verl's multi-turn keys leave the run single-turn and its turn length alone (that of
    # another verl line without them).
    cfg, _ = _load("grpo", [f"{MT}.enable=False"])
    plain, _ = _load("grpo", ["actor_rollout_ref.rollout.n=1"])
    assert not cfg.agent.enable and cfg.rollout.max_new_tokens == plain.rollout.max_new_tokens


# ------------------------------------------------------------------ the launch line runs
# verl's examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh, its keys after the
# config flags; sizes shrunk to 2 steps of a nano model (see _SHRINK).
VERL_MULTITURN = """
algorithm.adv_estimator=grpo
data.train_batch_size=256
data.max_prompt_length=1024
data.max_response_length=1024
data.filter_overlong_prompts=True
data.truncation='error'
data.return_raw_chat=True
actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct
actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32
actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.name=sglang
actor_rollout_ref.rollout.gpu_memory_utilization=0.85
actor_rollout_ref.rollout.n=16
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32
actor_rollout_ref.ref.fsdp_config.param_offload=True
actor_rollout_ref.rollout.mode=async
algorithm.use_kl_in_reward=False
trainer.critic_warmup=0
trainer.logger='["console","wandb"]'
trainer.project_name='multi-turn-grpo-qwen2.5-3b-sglang'
trainer.experiment_name=qwen2.5-3b_baseline
trainer.n_gpus_per_node=8
trainer.nnodes=1
trainer.save_freq=-1
trainer.test_freq=20
trainer.val_before_train=True
data.train_files=$HOME/data/gsm8k/train.parquet
data.val_files=$HOME/data/gsm8k/test.parquet
actor_rollout_ref.rollout.multi_turn.tool_config_path=TOOLS
trainer.total_epochs=15
"""

_SHRINK = {
    "data.train_batch_size": "4",
    "data.max_prompt_length": "512",
    "data.max_response_length": "48",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "4",
    "actor_rollout_ref.rollout.name": "hf",
    "actor_rollout_ref.rollout.n": "2",
    "trainer.logger": '["console","file"]',
    "trainer.n_gpus_per_node": "1",
    "trainer.val_before_train": "False",
    "trainer.total_epochs": "1",
}


def _gsm8k_rows(n: int) -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py writes them."""
    rows = []
    for i in range(n):
        truth = str(3 + i)
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [
                    {"role": "system", "content": "Use the `calc_gsm8k_reward` tool."},
                    {"role": "user", "content": f"What is 1 + {2 + i}?"},
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {
                    "split": "train",
                    "index": i,
                    "need_tools_kwargs": True,
                    "tools_kwargs": {
                        "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}
                    },
                },
            }
        )
    return rows


@pytest.mark.slow
def test_verls_multi_turn_tool_line_trains_multi_turn_with_tool_calls(
    tmp_path, tiny_qwen2_dir, monkeypatch
):
    """The launch line runs with its settings, and its rollouts take turns calling the tool.

    A random model never writes a tool call, so two things script it (the line stays
    verl's): the Hermes parser reads every model turn as a call of the GSM8K tool, and the
    model's generation_config ends a turn at many token ids, so turns end before the budget.
    """
    from polyrl.agent.tool_loop import HermesToolParser, ParsedToolCall
    from polyrl.data.io import write_rows

    started = time.perf_counter()
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen2_dir, model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen.get("eos_token_id", 4), *range(20, 1024, 3)]
    (model / "generation_config.json").write_text(json.dumps(gen))
    monkeypatch.setattr(
        HermesToolParser,
        "parse",
        lambda self, text: [ParsedToolCall("calc_gsm8k_reward", {"answer": "3"})],
    )
    train, test = tmp_path / "train.parquet", tmp_path / "test.parquet"
    write_rows(_gsm8k_rows(8), train)
    write_rows(_gsm8k_rows(4), test)
    config, tools = _write_configs(tmp_path, prompt=512, response=48, batch=4)
    paths = {
        "actor_rollout_ref.model.path": str(model),
        "data.train_files": str(train),
        "data.val_files": str(test),
        "actor_rollout_ref.rollout.multi_turn.tool_config_path": str(tools),
    }
    args = []
    for line in VERL_MULTITURN.split():
        key, _, value = line.partition("=")
        value = paths.get(key, _SHRINK.get(key, value))
        if len(value) >= 2 and value[0] == value[-1] == "'":
            value = value[1:-1]  # the shell strips one level of quotes
        args.append(f"{key}={value}")
    out = tmp_path / "out"
    code = main(
        [
            "train",
            f"--config-path={config}",
            "--config-name=gsm8k_multiturn_grpo",
            *args,
            f"trainer.default_local_dir={out}",
            # The test machine: CPU, engines in local processes.
            "trainer.device=cpu",
            "trainer.worker_backend=local",
        ]
    )
    assert code == 0
    cfg = load_config(out / "rl_config.yaml")
    # verl's meaning of the line and its base YAML.
    assert cfg.agent.enable and cfg.agent.default_loop == "tool" and cfg.agent.max_turns == 5
    assert cfg.agent.tool_config == str(tools) and cfg.agent.tools == []
    assert cfg.data.max_response_length == 48 and cfg.rollout.max_new_tokens == 48
    assert cfg.data.max_prompt_length == 512 and cfg.data.truncation == "filter"
    assert cfg.actor.optim.lr == 1e-6 and cfg.actor.use_kl_loss
    assert cfg.actor.kl_loss_coef == 0.001 and cfg.actor.kl_loss_type == "low_var_kl"
    assert cfg.rollout.backend == "native" and cfg.rollout.n == 2
    assert cfg.trainer.loggers == ["console", "jsonl"] and cfg.trainer.save_freq == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "num_turns/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["num_turns/mean"] > 1.0  # the tool answered and the model went on
        assert r["tool_calls/mean"] >= 1.0 and r["tool_errors/mean"] == 0.0
        assert r["actor/num_tokens"] < r["perf/response_tokens"]  # tool tokens are masked
    print(f"verl multi-turn line: {time.perf_counter() - started:.1f}s")
