"""Megatron backend config: polyrl keys, verl keys, refusals (no Megatron needed)."""

from __future__ import annotations

import importlib.util

import pytest

from polyrl.config import ConfigError, load_config
from polyrl.config.options import constructor_kwargs
from polyrl.model_engine import EngineConfig, MegatronConfig, ParallelismConfig
from polyrl.model_engine.engine import available_engines


def test_verl_strategy_and_megatron_sizes_map_onto_the_actor():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.strategy=megatron",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
        ],
    )
    assert cfg.actor.engine_backend == "megatron"
    assert cfg.actor.megatron.expert_model_parallel_size == 2
    par = ParallelismConfig(**constructor_kwargs(ParallelismConfig, cfg.actor.megatron))
    assert par.expert_parallel_size == 2 and par.tensor_parallel_size == 1
    engine = EngineConfig(**constructor_kwargs(EngineConfig, cfg.actor, parallelism=par))
    assert engine.backend == "megatron"
    assert isinstance(engine.megatron, MegatronConfig)
    assert load_config(None, ["actor_rollout_ref.actor.strategy=fsdp"]).actor.engine_backend == (
        "fsdp2"
    )


def test_refusals():
    with pytest.raises(ConfigError, match="engine_backend=megatron"):
        load_config(None, ["actor.megatron.expert_model_parallel_size=2"])
    with pytest.raises(ConfigError):
        load_config(
            None, ["actor.engine_backend=megatron", "actor.megatron.pipeline_model_parallel_size=2"]
        )
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelismConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="transformer_impl"):
        MegatronConfig(transformer_impl="apex")


def test_the_rl_trainer_takes_megatron_tp_that_divides_the_world():
    from polyrl.trainer.rl.checks import check_config

    tp2 = ["actor.engine_backend=megatron", "actor.megatron.tensor_model_parallel_size=2"]
    # Two ranks make one tensor-parallel replica: the dispatch gives both the same rows.
    check_config(load_config("demo", [*tp2, "trainer.n_gpus_per_node=2"]))
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size \(2\).*world_size \(3\)"):
        check_config(load_config("demo", [*tp2, "trainer.n_gpus_per_node=3"]))
    ep4 = ["actor.engine_backend=megatron", "actor.megatron.expert_model_parallel_size=4"]
    with pytest.raises(ConfigError, match=r"expert_model_parallel_size \(4\)"):
        check_config(load_config("demo", [*ep4, "trainer.n_gpus_per_node=2"]))


def test_the_backend_is_registered_and_needs_the_extra(tmp_path):
    assert "megatron" in available_engines()
    if importlib.util.find_spec("megatron") is not None:
        pytest.skip("megatron-core is installed; tests_megatron covers the backend")
    from polyrl.model_engine import build_engine
    from polyrl.models.tiny import build_tiny_model

    model = build_tiny_model("qwen2", tmp_path / "m", size="nano")
    with pytest.raises(ImportError, match=r"polyrl\[megatron\]"):
        build_engine(str(model), {"backend": "megatron", "device": "cpu"})
