"""Engine workers on the single controller: actor / critic / reference roles over real Ray.

The 2-rank group checks log-probs against a plain Hugging Face model and an update step against
a world-size-1 engine in this process; the colocated group runs actor, reference and critic in
one process through role-prefixed methods.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "engine_scripts"))

from engine_common import (  # noqa: E402
    clean_loss_mask,
    make_batch,
    make_group_batch,
    reference_log_probs,
    tiny_model,
)

from polyrl.controller import WorkerError, WorkerGroup, WorkerSpec  # noqa: E402
from polyrl.core.batch import Batch  # noqa: E402
from polyrl.model_engine import build_engine, sft_loss  # noqa: E402
from polyrl.workers.engine import (  # noqa: E402
    LOG_PROBS_KEY,
    REF_LOG_PROBS_KEY,
    VALUES_KEY,
    EngineWorker,
    available_losses,
    pad_batch_for_dp,
    register_loss,
    resolve_loss,
)

VOCAB = 1000
ENGINE = {"device": "cpu", "share_prefix": True}
SGD = {"name": "sgd", "lr": 0.5}


def value_mse(output, batch, target: float = 0.0):
    """Critic loss used through its import path: mean squared distance of values to target."""
    from polyrl.core.numerics import agg_loss
    from polyrl.model_engine import global_counts

    mask = batch["loss_mask"]
    loss = agg_loss((output.values - target) ** 2, mask, "token-mean", **global_counts(batch))
    return loss, {}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("workers") / "qwen2")


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def _actor(tiny_dir: str, optimizer=SGD, role: str = "actor") -> WorkerSpec:
    return WorkerSpec(
        EngineWorker,
        kwargs={"role": role, "model": tiny_dir, "engine": ENGINE, "optimizer": optimizer},
    )


# ------------------------------------------------------------------------------ no Ray needed
def test_loss_registry_names_import_paths_and_kwargs():
    assert resolve_loss("sft") is sft_loss
    assert "sft" in available_losses()
    bound = resolve_loss(f"{__name__}:value_mse", {"target": 1.5})
    assert bound.keywords == {"target": 1.5} and bound.func is value_mse
    with pytest.raises(ValueError, match=r"unknown loss 'nope'.*sft"):
        resolve_loss("nope")
    with pytest.raises(ValueError, match="does not accept kwargs"):
        resolve_loss("sft", {"beta": 1.0})
    with pytest.raises(ValueError, match="has no attribute"):
        resolve_loss(f"{__name__}:missing")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_loss("no_such_module_xyz:f")

    @register_loss("test_workers_twice")
    def first(output, batch):
        return sft_loss(output, batch)

    def other(output, batch):
        return sft_loss(output, batch)

    with pytest.raises(ValueError, match="already registered"):
        register_loss("test_workers_twice")(other)
    with pytest.raises(ValueError, match="without ':'"):
        register_loss("a:b")


def test_pad_batch_for_dp_adds_rows_without_loss():
    batch = make_batch(5, 8, VOCAB, seed=1)
    padded, added = pad_batch_for_dp(batch, 4)
    assert added == 3 and len(padded) == 8
    assert torch.equal(padded["input_ids"][5:], batch["input_ids"][:3])
    assert padded["loss_mask"][5:].abs().sum() == 0
    assert torch.equal(padded["loss_mask"][:5], batch["loss_mask"])
    same, none = pad_batch_for_dp(batch, 5)
    assert none == 0 and same is batch
    with pytest.raises(KeyError, match="weights"):
        pad_batch_for_dp(batch, 2, zero_keys=("weights",))
    with pytest.raises(ValueError, match="dp_size"):
        pad_batch_for_dp(batch, 0)


def test_worker_roles_are_validated(tiny_dir):
    with pytest.raises(ValueError, match="role must be one of"):
        EngineWorker(role="policy", model=tiny_dir)
    with pytest.raises(ValueError, match="critic role needs a 'value' model"):
        EngineWorker(role="critic", model={"path": tiny_dir, "kind": "causal_lm"})
    ref = EngineWorker(role="ref", model=tiny_dir)
    assert ref.engine_role == "reference"
    with pytest.raises(RuntimeError, match="init_model"):
        _ = ref.engine
    with pytest.raises(RuntimeError, match="needs the actor role"):
        ref.update_actor(make_batch(2, 6, VOCAB))


# ------------------------------------------------------------------------------ real Ray
@pytest.mark.slow
def test_two_rank_actor_matches_hf_and_a_single_process_engine(ray_session, tiny_dir, hf_model):
    batch = make_batch(6, 12, VOCAB, seed=3, left_pad_rows=2)
    group = WorkerGroup(_actor(tiny_dir), world_size=2, name="actor-dp2")
    local = None
    try:
        infos = group.init_model()
        assert [(i["rank"], i["world_size"]) for i in infos] == [(0, 2), (1, 2)]
        assert len({w.pid for w in group.worker_info}) == 2

        expected = reference_log_probs(hf_model, batch)
        got = group.compute_log_prob(batch)[LOG_PROBS_KEY]
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < 1e-5
        # An odd row count is padded by the dispatcher and unpadded on the way back.
        odd = batch[:5]
        assert torch.allclose(group.compute_log_prob(odd)[LOG_PROBS_KEY], expected[:5], atol=1e-5)

        before = group.weight_digest()
        metrics = group.update_actor(batch, "sft")
        after = group.weight_digest()
        assert after[0] == after[1], "ranks disagree on the updated weights"
        assert after[0] != before[0]

        local = build_engine(tiny_dir, ENGINE, SGD)
        ref = local.train_batch(batch, sft_loss)
        assert metrics["actor/loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert metrics["actor/grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert metrics["actor/num_updates"] == 1.0
        weights = group.gather_weights()
        assert weights[1] is None
        mine = {name: t.clone() for name, t in local.named_tensors()}
        assert sorted(weights[0]) == sorted(mine)
        worst = max((weights[0][k] - mine[k]).abs().max().item() for k in mine)
        assert worst < 1e-5
        initial = dict(hf_model.named_parameters())
        moved = max((weights[0][k] - initial[k]).abs().max().item() for k in mine if k in initial)
        assert moved > 1e-3

        updated = group.compute_log_prob(batch)[LOG_PROBS_KEY]
        assert torch.allclose(updated, local.infer_batch(batch)["log_probs"], atol=1e-5)
    finally:
        if local is not None:
            local.close()
        group.shutdown()


@pytest.fixture(scope="module")
def colocated(ray_session, tiny_dir):
    roles = {
        "actor": _actor(tiny_dir, optimizer={"name": "adamw", "lr": 1e-2}),
        "ref": _actor(tiny_dir, role="ref"),
        "critic": WorkerSpec(
            EngineWorker,
            kwargs={"role": "critic", "model": tiny_dir, "engine": ENGINE, "optimizer": SGD},
        ),
    }
    group = WorkerGroup(roles, world_size=1, name="actor-ref-critic")
    for role in ("actor", "ref", "critic"):
        assert group.role(role).init_model()[0]["world_size"] == 1
    yield group
    group.shutdown()


def test_colocated_actor_ref_critic_in_one_process(colocated, hf_model, tmp_path):
    group = colocated
    assert len(group.worker_info) == 1  # every role lives in the same process
    batch = make_batch(4, 10, VOCAB, seed=5)
    expected = reference_log_probs(hf_model, batch)
    ref0 = group.ref_compute_ref_log_prob(batch)[REF_LOG_PROBS_KEY]
    assert (ref0 - expected).abs().max().item() < 1e-5

    saved = group.actor_save_checkpoint(str(tmp_path / "ckpt"), 7, {"sampler": {"epoch": 2}})[0]
    metrics = group.actor_update_actor(batch, "sft")
    assert set(metrics) >= {"actor/loss", "actor/grad_norm", "actor/lr", "actor/lr_next"}
    trained = group.actor_compute_log_prob(batch, with_entropy=True)
    assert set(trained.keys()) == {LOG_PROBS_KEY, "entropy"}
    assert (trained[LOG_PROBS_KEY] - ref0).abs().max().item() > 1e-4  # the actor moved
    ref1 = group.ref_compute_ref_log_prob(batch)[REF_LOG_PROBS_KEY]
    assert torch.equal(ref0, ref1)  # the colocated reference did not

    info = group.actor_load_checkpoint(saved)[0]
    assert info["step"] == 7 and info["extra_state"] == {"sampler": {"epoch": 2}}
    restored = group.actor_compute_log_prob(batch)[LOG_PROBS_KEY]
    assert (restored - ref0).abs().max().item() < 1e-6

    # Critic: one value per token, trained with a loss passed by import path + kwargs.
    values = group.critic_compute_values(batch)[VALUES_KEY]
    assert values.shape == batch["input_ids"].shape
    assert values[batch["attention_mask"] == 0].abs().sum() == 0
    mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    before = ((values - 3.0) ** 2)[mask].mean()
    out = group.critic_update_critic(batch, f"{__name__}:value_mse", {"target": 3.0})
    assert out["critic/loss"] == pytest.approx(before.item(), rel=0.05)
    after = ((group.critic_compute_values(batch)[VALUES_KEY] - 3.0) ** 2)[mask].mean()
    assert after < before


def test_every_handle_method_is_a_worker_method_with_its_signature():
    import inspect

    from polyrl.controller.dispatch import registered_methods
    from polyrl.workers import handles

    registered = registered_methods(EngineWorker)
    classes = (handles.ActorHandle, handles.ReferenceHandle, handles.CriticHandle)
    for cls in (*classes, handles.PRMHandle):
        methods = [n for n, f in vars(cls).items() if inspect.isfunction(f) and n[0] != "_"]
        for base in cls.__mro__[1:-1]:
            methods += [n for n, f in vars(base).items() if inspect.isfunction(f) and n[0] != "_"]
        for name in methods:
            assert name in registered, f"{cls.__name__}.{name} is no registered worker method"
            # The parameters are the worker's; the result is what the group's dispatch makes.
            ours = inspect.signature(getattr(cls, name)).parameters
            theirs = inspect.signature(getattr(EngineWorker, name)).parameters
            assert list(ours.values()) == list(theirs.values()), f"{cls.__name__}.{name}"


def test_typed_handles_drive_the_colocated_roles(colocated):
    from polyrl.workers.handles import EngineHandles

    engines = EngineHandles.of({role: colocated.role(role) for role in colocated.roles})
    assert list(engines.started()) == ["actor", "ref", "critic"] and engines.prm is None
    batch = make_batch(2, 8, VOCAB, seed=3)
    ref = engines.ref.compute_ref_log_prob(batch)[REF_LOG_PROBS_KEY]
    assert torch.equal(ref, colocated.ref_compute_ref_log_prob(batch)[REF_LOG_PROBS_KEY])
    values = engines.critic.compute_values(batch)[VALUES_KEY]
    assert values.shape == batch["input_ids"].shape
    assert engines.actor.weight_digest() == colocated.actor_weight_digest()
    with pytest.raises(ValueError, match="must include 'actor'"):
        EngineHandles.of({"ref": colocated.role("ref")})


def test_log_probs_with_shared_prefixes_match_on_response_tokens(colocated, hf_model):
    """share_prefix=True (what the RL trainer asks for) changes only positions no loss reads."""
    group = colocated
    batch = make_group_batch(prompts=3, n=4, prompt_width=6, response_width=7, vocab=VOCAB)
    expected = reference_log_probs(hf_model, batch)
    mask = clean_loss_mask(batch) != 0
    ref = group.ref_compute_ref_log_prob(batch, share_prefix=True)[REF_LOG_PROBS_KEY]
    assert (ref[mask] - expected[mask]).abs().max().item() < 1e-5
    assert bool((ref[:, :5] == 0).all())  # prompt positions are not computed
    full = group.actor_compute_log_prob(batch)[LOG_PROBS_KEY]
    shared = group.actor_compute_log_prob(batch, share_prefix=True)[LOG_PROBS_KEY]
    assert (shared[mask] - full[mask]).abs().max().item() < 1e-5
    assert (full[:, :5] != 0).any()  # without the flag every position is computed
    assert batch.meta == {}  # the caller's batch is not modified


def test_colocated_roles_refuse_wrong_calls_and_offload(colocated, tmp_path):
    group = colocated
    batch = make_batch(2, 8, VOCAB, seed=9)
    with pytest.raises(WorkerError, match="needs the actor role"):
        group.ref_update_actor(batch, "sft")
    with pytest.raises(WorkerError, match="needs the critic role"):
        group.actor_compute_values(batch)
    with pytest.raises(WorkerError, match="unknown loss 'nope'"):
        group.actor_update_actor(batch, "nope")

    group.actor_offload()
    with pytest.raises(WorkerError, match="offloaded"):
        group.actor_compute_log_prob(batch)
    group.actor_reload()
    lp = group.actor_compute_log_prob(batch)[LOG_PROBS_KEY]

    out = group.actor_export_hf(str(tmp_path / "hf"))[0]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (reference_log_probs(exported, batch) - lp).abs().max().item() < 1e-5
    assert isinstance(group.actor_evaluate_loss(batch)["loss"], float)


def test_worker_outside_a_group_runs_the_engine_in_process(tiny_dir, hf_model):
    worker = EngineWorker(role="actor", model=tiny_dir, engine=ENGINE, optimizer=SGD)
    try:
        assert worker.init_model()["world_size"] == 1
        batch = make_batch(3, 9, VOCAB, seed=11)
        lp = worker.compute_log_prob(batch)[LOG_PROBS_KEY]
        assert (lp - reference_log_probs(hf_model, batch)).abs().max().item() < 1e-5
        names = [name for name, _ in worker.named_tensors()]
        assert "model.embed_tokens.weight" in names
        loss = worker.evaluate_loss(batch)["loss"]
        metrics = worker.update_actor(Batch.concat([batch, batch]), "sft", num_mini_batches=2)
        assert metrics["actor/num_updates"] == 2.0
        # The mean of two steps on the same rows: the first sees the evaluated loss, the
        # second a model already improved on them.
        assert 0.5 * loss < metrics["actor/loss"] < loss - 1e-3
    finally:
        worker.close_model()
