"""Run settings resolved once (issue 33, item 4).

Every option an RL run leaves to ``auto`` is decided once into a frozen
:class:`~polyrl.trainer.rl.settings.RunSettings`, and the run directory's config file shows the
decided values; a preset's mini-batch size that does not fit the batch the user gave, or a token
budget below the lengths the user gave, yields to them, with a note, while a value the user
wrote stays an error.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import yaml

from polyrl.config import ConfigError, ConfigNote, describe, load_config
from polyrl.trainer.common import save_run_config, with_training_autos
from polyrl.trainer.rl.checks import check_config
from polyrl.trainer.rl.settings import (
    RunSettings,
    resolve_settings,
    resolved_config,
    save_rl_config,
)

#: The options a run resolves (resolved_config writes them).
RESOLVED = {
    "trainer.device",
    "model.compute_dtype",
    "rollout.device",
    "rollout.placement",
    "rollout.dtype",
    "rollout.matmul_dtype",
    "rollout.gpus_per_replica",
    "rollout.replicas",
    "rollout.sleep_during_training",
    "rollout.weight_transport",
    "transfer.backend",
    "reward.model_device",
}
GPU_RUN = ["trainer.device=cuda", "trainer.worker_backend=local", "trainer.n_gpus_per_node=4"]


def _flat(cfg) -> dict:
    return {o.key: o.default for o in describe(cfg)}


def _auto_keys(cfg) -> set[str]:
    """The options of ``cfg`` that say auto (``rollout.replicas``: 0 is auto)."""
    flat = _flat(cfg)
    keys = {k for k, v in flat.items() if v == "auto"}
    return keys | ({"rollout.replicas"} if flat["rollout.replicas"] == 0 else set())


# ------------------------------------------------------------------ the record
def test_settings_are_resolved_once_into_a_frozen_record():
    cpu = resolve_settings(load_config("demo", ["trainer.device=cpu"]))
    assert (cpu.training_device, cpu.rollout_device, cpu.placement) == ("cpu", "cpu", "separate")
    assert (cpu.rollout_dtype, cpu.matmul_dtype, cpu.compute_dtype) == ("float32",) * 3
    assert (cpu.gpus_per_replica, cpu.replicas, cpu.sleeps_during_training) == (0, 1, False)
    assert cpu.transfer_backend == "local" and not cpu.trains_on_gpu and not cpu.shares_gpu
    gpu = resolve_settings(load_config("demo", GPU_RUN))
    assert (gpu.training_device, gpu.placement, gpu.rollout_dtype) == ("cuda", "hybrid", "bfloat16")
    assert (gpu.compute_dtype, gpu.matmul_dtype) == ("bfloat16", "bfloat16")
    assert (gpu.gpus_per_replica, gpu.replicas) == (1, 4) and gpu.sleeps_during_training
    assert gpu.shares_gpu
    with pytest.raises(dataclasses.FrozenInstanceError):
        gpu.replicas = 2  # type: ignore[misc]


def test_the_step_shape_comes_with_the_settings():
    ppo = resolve_settings(load_config("ppo", ["trainer.device=cpu"]))
    assert ppo.use_critic and not ppo.use_prm
    assert ppo.num_mini_batches == 2 and ppo.need_old_log_probs  # 32 prompts in 16s
    prime = resolve_settings(load_config("prime", ["trainer.device=cpu"]))
    assert prime.use_prm and prime.use_ref and prime.prm_mini_batches == 1
    one = resolve_settings(load_config("demo", ["trainer.device=cpu", "actor.use_kl_loss=false"]))
    assert one.num_mini_batches == 1 and not one.need_old_log_probs and not one.use_ref
    assert not one.off_policy
    ahead = load_config(
        "demo", ["trainer.device=cpu", "trainer.mode=one_step_off", "async.correction=tis"]
    )
    assert resolve_settings(ahead).off_policy


# ------------------------------------------------------------------ the config file
@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.device=cpu"],
        ["trainer.device=auto"],
        GPU_RUN,
        [*GPU_RUN, "rollout.backend=vllm", "rollout.tensor_parallel_size=2"],
        [*GPU_RUN, "rollout.placement=separate", "rollout.replicas=2", "transfer.enable=true"],
    ],
)
def test_the_run_config_file_shows_every_auto_resolved(tmp_path, overrides):
    cfg = load_config("demo", overrides)
    settings = resolve_settings(cfg)
    path = save_rl_config(cfg, settings, tmp_path / "rl_config.yaml", transport="shm")
    autos = _auto_keys(cfg)
    saved = load_config(path)  # the file loads back as a config
    left = _auto_keys(saved)
    # matmul_dtype applies to the native backend only; elsewhere it must stay auto.
    assert left == ({"rollout.matmul_dtype"} if cfg.rollout.backend != "native" else set())
    assert saved == resolved_config(cfg, settings, "shm")
    flat = _flat(saved)
    assert flat["trainer.device"] == settings.training_device
    assert flat["rollout.replicas"] == settings.replicas
    assert flat["rollout.dtype"] == settings.rollout_dtype
    # Every other option is kept as set.
    given = _flat(cfg)
    assert all(flat[k] == v for k, v in given.items() if k not in RESOLVED)
    # The header says what the run decided, from what.
    text = path.read_text()
    assert text.startswith("# Settings this run resolved")
    assert "#   rollout.weight_transport: 'auto' -> 'shm'" in text
    assert all(f"#   {key}:" in text for key in autos - left)


def test_the_transport_stays_auto_until_the_servers_run(tmp_path):
    cfg = load_config("demo", ["trainer.device=cpu"])
    path = save_rl_config(cfg, resolve_settings(cfg), tmp_path / "rl_config.yaml")
    assert load_config(path).rollout.weight_transport == "auto"
    assert _auto_keys(load_config(path)) == {"rollout.weight_transport"}


def test_resolved_settings_read_back_resolve_to_themselves(tmp_path):
    cfg = load_config("demo", GPU_RUN)
    settings = resolve_settings(cfg)
    again = resolve_settings(resolved_config(cfg, settings, "cuda_ipc"))
    assert again == settings
    assert isinstance(again, RunSettings)


def test_sft_and_preference_config_files_show_the_device_and_compute_dtype(tmp_path):
    for preset in ("sft_demo", "dpo_demo"):
        cfg = load_config(preset, ["trainer.device=auto"])
        path = save_run_config(cfg, with_training_autos(cfg), tmp_path / f"{preset}.yaml")
        saved = yaml.safe_load(path.read_text())
        assert saved["trainer"]["device"] in ("cpu", "cuda")
        assert saved["model"]["compute_dtype"] in ("float32", "bfloat16", "float16")
        text = path.read_text()
        assert "#   trainer.device: 'auto' -> " in text
        assert "#   model.compute_dtype: 'auto' -> " in text


# ------------------------------------------------------------------ presets yield
def _load(preset: str, overrides: list[str]):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(preset, overrides)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigNote)]


def _yields(preset: str, overrides: list[str], note: str):
    """Load with ``overrides``: a note says ``note``, and the trainer's checks pass."""
    cfg, notes = _load(preset, [*overrides, "trainer.device=cpu"])
    assert any(note in n for n in notes), notes
    check_config(cfg)
    return cfg


def test_a_presets_mini_batch_yields_to_the_users_batch_size():
    # As a TRL user tries it: the 16 is the preset's, not the user's.
    _yields(
        "grpo",
        ["data.train_batch_size=4"],
        "preset 'grpo' sets actor.ppo_mini_batch_size=16, which does not fit the given "
        "data.train_batch_size=4; using 4",
    )
    assert _load("grpo", ["data.train_batch_size=4"])[0].actor.ppo_mini_batch_size == 4
    # The largest size up to the preset's that divides the batch.
    assert _load("grpo", ["data.train_batch_size=24"])[0].actor.ppo_mini_batch_size == 12
    # A batch the preset's size fits leaves it, without a note.
    cfg, notes = _load("grpo", ["data.train_batch_size=64"])
    assert cfg.actor.ppo_mini_batch_size == 16 and not notes
    # Each rank needs a row per mini-batch: 32 prompts x 1 response over 32 ranks leave one
    # row each, so the 16 (which divides 32) yields to one mini-batch of the whole batch.
    shape = ["data.train_batch_size=32", "rollout.n=1", "trainer.n_gpus_per_node=32"]
    cfg, notes = _load("grpo", shape)
    assert cfg.actor.ppo_mini_batch_size == 32 and "trainer.n_gpus_per_node=32" in notes[-1]


def test_a_mini_batch_the_user_wrote_stays_an_error():
    cfg, notes = _load("grpo", ["data.train_batch_size=4", "actor.ppo_mini_batch_size=16"])
    assert cfg.actor.ppo_mini_batch_size == 16 and not notes
    with pytest.raises(ConfigError, match=r"16 must divide data.train_batch_size \(4\)") as err:
        check_config(cfg)
    assert err.value.key == "actor.ppo_mini_batch_size"
    # verl's spelling of it is the user's too.
    cfg, _ = _load(
        "grpo", ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]
    )
    assert cfg.actor.ppo_mini_batch_size == 16


def test_a_token_budget_the_user_did_not_set_holds_the_given_lengths():
    # 1024 prompt tokens + the whole multi-turn trajectory (the tool loop is on).
    cfg = _yields(
        "grpo_tool",
        ["data.max_response_length=20000"],
        "actor.max_tokens_per_micro_batch=16384, which you did not set, is below the longest "
        "sequence of the given data.max_response_length=20000 (21024 tokens); using 21024",
    )
    assert cfg.actor.max_tokens_per_micro_batch == 21024
    # A turn capped lower keeps the budget.
    cfg, notes = _load(
        "demo", ["data.max_response_length=20000", "rollout.max_new_tokens=8", "trainer.device=cpu"]
    )
    assert cfg.actor.max_tokens_per_micro_batch == 16384 and not notes
    # A budget the user wrote stays an error.
    cfg, _ = _load(
        "demo", ["data.max_response_length=20000", "actor.max_tokens_per_micro_batch=1000"]
    )
    with pytest.raises(ConfigError, match="1000 is below the longest sequence"):
        check_config(cfg)


@pytest.mark.parametrize(
    ("line", "script"),
    [
        ("rollout.backend=vllm", "scripts/setup_vllm_venv.sh (or make test-vllm)"),
        ("actor_rollout_ref.rollout.name=vllm", "scripts/setup_vllm_venv.sh (or make test-vllm)"),
        ("rollout.backend=sglang", "scripts/setup_sglang_venv.sh"),
    ],
)
def test_an_engine_without_its_venv_is_one_line_before_the_run(
    tmp_path, monkeypatch, capsys, line, script
):
    from polyrl.cli import main

    for name in ("POLYRL_VLLM_VENV", "POLYRL_SGLANG_VENV"):
        monkeypatch.setenv(name, str(tmp_path / "missing-venv"))
    out = str(tmp_path / "run")
    assert main(["train", "grpo", line, "trainer.device=cpu", f"trainer.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    # One error line (a verl line also gets its one note that verl's defaults apply).
    errors = [line for line in err.splitlines() if line.startswith("polyrl: error")]
    assert len(errors) == 1 and "rollout.backend: is " in errors[0] and script in errors[0], err
    assert all(line.startswith(("polyrl: error", "polyrl: note")) for line in err.splitlines())
    assert not (tmp_path / "run").exists()  # refused before anything started
