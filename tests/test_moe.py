"""Mixture-of-experts: routing replay (R3), router metrics and the load-balancing loss."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_rollout_native_fast import run

from polyrl.core.batch import Batch
from polyrl.core.columns import ROUTED_EXPERTS
from polyrl.core.rollout_api import GenerateRequest, SampleOutput, SamplingParams
from polyrl.core.rollout_batch import build_rollout_batch
from polyrl.model_engine import build_engine
from polyrl.model_engine.moe import RouterHooks
from polyrl.models.loader import load_causal_lm
from polyrl.models.moe import moe_geometry, moe_routers
from polyrl.models.tiny import build_tiny_model
from polyrl.rollout.native.engine import NativeEngine, NativeEngineConfig
from polyrl.rollout.native.routes import RouteRecorder

SMALL = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "kv_cache_tokens": 4096}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE (8 experts, top-2) whose experts matter.

    Random-init experts add almost nothing to the residual stream, so which ones a token goes
    to barely moves its log-prob; in a trained MoE it moves it a lot. Scaling the experts' weights
    gives the tiny model that property, which is what routing replay is about.
    """
    root = tmp_path_factory.mktemp("moe")
    base = build_tiny_model("qwen3_moe", root / "base", size="nano", experts=8, experts_per_tok=2)
    model = load_causal_lm(base)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.mul_(4.0)
    out = root / "scaled"
    shutil.copytree(base, out)
    model.save_pretrained(out)
    return str(out)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 30, (n,), generator=g).tolist()
    return [torch.randint(16, 1000, (k,), generator=g).tolist() for k in lens]


def _routes_column(prompts, samples, width: int, geometry) -> torch.Tensor:
    """The ROUTED_EXPERTS column of a rollout batch (prompts left-padded to a common width)."""
    wp = max(len(p) for p in prompts)
    col = torch.full((len(prompts), width, geometry.layers, geometry.top_k), -1, dtype=torch.long)
    for i, (p, s) in enumerate(zip(prompts, samples, strict=True)):
        rows = torch.tensor(s.routed_experts)
        col[i, wp - len(p) : wp - len(p) + rows.shape[0]] = rows
    return col


def test_forced_own_routes_reproduce_logits_and_reach_the_router(moe_dir):
    model = load_causal_lm(moe_dir)
    geometry = moe_geometry(model)
    assert geometry is not None and (geometry.layers, geometry.top_k) == (4, 2)
    ids = torch.tensor(_prompts(2, seed=5)[0]).unsqueeze(0)

    recorder = RouteRecorder(model)
    recorder.start()
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
    routes = torch.from_numpy(recorder.collect()).long()  # (T, layers, k)
    recorder.remove()
    assert routes.shape == (ids.shape[1], 4, 2)

    hooks = RouterHooks(model)
    hooks.begin(routes)
    forced = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(forced, plain)  # bit for bit
    # The router still gets a gradient through the forced experts' weights.
    forced.float().logsumexp(-1).sum().backward()
    router = moe_routers(model)[0]
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    hooks.end()

    # Other routes change the output; rows of -1 keep the router's own choice.
    other = (routes + 1) % geometry.experts
    with torch.no_grad():
        hooks.begin(other)
        moved = model(input_ids=ids, use_cache=False).logits
        hooks.begin(torch.full_like(routes, -1))
        kept = model(input_ids=ids, use_cache=False).logits
    hooks.end()
    assert (moved - plain).abs().max() > 1e-3
    assert torch.equal(kept, plain)


def test_native_engine_returns_routed_experts(moe_dir):
    eng = NativeEngine(moe_dir, NativeEngineConfig(**SMALL))
    eng.start()
    try:
        ps = _prompts(3, seed=2)
        asked = SamplingParams(
            max_new_tokens=6, temperature=0, ignore_eos=True, n=2, return_routed_experts=True
        )
        plain = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
        reqs = [GenerateRequest(f"r{i}", tuple(p), asked) for i, p in enumerate(ps)]
        reqs.append(GenerateRequest("plain", tuple(ps[0]), plain))
        outs = run(eng, reqs)
    finally:
        eng.shutdown()
    assert outs["plain"][0].routed_experts is None
    assert "routed_experts" not in outs["plain"][0].to_dict()
    assert "return_routed_experts" not in plain.to_dict()

    model = load_causal_lm(moe_dir)
    recorder = RouteRecorder(model)
    for i, p in enumerate(ps):
        for sample in outs[f"r{i}"]:  # the leader and its forked follower
            rows = torch.tensor(sample.routed_experts)
            full = p + sample.output_ids
            assert rows.shape == (len(full), 4, 2)
            assert (rows[-1] == -1).all()  # the last token is never fed back
            recorder.start()
            with torch.no_grad():
                model(input_ids=torch.tensor([full]), use_cache=False)
            ref = torch.from_numpy(recorder.collect()).long()[:-1]
            # The same float32 model: the same experts (as sets: ties may swap order).
            same = rows[:-1].sort(-1).values == ref.sort(-1).values
            assert same.float().mean() > 0.99, f"prompt {i}: {same.float().mean():.3f}"
    assert "routed_experts" in outs["r0"][0].to_dict()


def test_engine_replay_of_own_routes_is_exact(moe_dir):
    engine = build_engine(moe_dir)
    try:
        model = load_causal_lm(moe_dir)
        ps = _prompts(4, seed=7)
        responses = [p[:5] for p in _prompts(4, seed=8)]
        batch = build_rollout_batch(ps, responses, 0)
        # Routes of each row recorded one row at a time (no padding around it).
        recorder = RouteRecorder(model)
        samples = []
        for p, r in zip(ps, responses, strict=True):
            recorder.start()
            with torch.no_grad():
                model(input_ids=torch.tensor([p + r]), use_cache=False)
            samples.append(SampleOutput(0, routed_experts=recorder.collect().tolist()))
        width = batch["input_ids"].shape[1]
        col = _routes_column(ps, samples, width, moe_geometry(model))
        base = engine.infer_batch(batch)["log_probs"]
        replay = engine.infer_batch(Batch(tensors={**batch.tensors, ROUTED_EXPERTS: col}))[
            "log_probs"
        ]
        mask = batch["attention_mask"].bool()
        assert (replay - base)[mask].abs().max() < 1e-5
        # A training step with replay gives the router gradients and reports router metrics.
        batch.tensors[ROUTED_EXPERTS] = col

        def loss_fn(output, mb):
            lp = output.log_probs
            return -(lp * mb["loss_mask"]).sum() / mb.meta["global_token_count"], {}

        metrics = engine.forward_backward(batch, loss_fn)
        assert metrics["moe/drop_rate"] == 0.0
        assert 0 < metrics["moe/load_min"] <= 1 / 8 <= metrics["moe/load_max"] <= 1
        assert metrics["moe/load_mean"] == pytest.approx(1 / 8)
        grads = [p.grad for n, p in engine.model.named_parameters() if n.endswith("gate.weight")]
        assert grads and all(g is not None for g in grads)
    finally:
        engine.close()


def test_r3_halves_rollout_trainer_log_prob_gap(moe_dir):
    """The acceptance measurement: a bf16 rollout against a float32 trainer.

    Inference commonly runs another numeric path than training; here the rollout serves the
    model in bfloat16 and the trainer computes in float32. Near-tied router scores then pick
    other experts in one than in the other, and replaying the rollout's routes in the trainer
    removes that part of the log-prob mismatch.
    """
    eng = NativeEngine(moe_dir, NativeEngineConfig(dtype="bfloat16", **SMALL))
    eng.start()
    try:
        ps = _prompts(8)
        params = SamplingParams(
            max_new_tokens=24,
            temperature=1.0,
            seed=3,
            logprobs=True,
            ignore_eos=True,
            return_routed_experts=True,
        )
        reqs = [GenerateRequest(f"r{i}", tuple(p), params) for i, p in enumerate(ps)]
        outs = run(eng, reqs)
    finally:
        eng.shutdown()
    samples = [outs[f"r{i}"][0] for i in range(len(ps))]
    batch = build_rollout_batch(
        ps, [s.output_ids for s in samples], 0, [s.logprobs for s in samples]
    )
    engine = build_engine(moe_dir)
    try:
        geometry = moe_geometry(engine.model)
        col = _routes_column(ps, samples, batch["input_ids"].shape[1], geometry)
        base = engine.infer_batch(batch)["log_probs"]
        replay = engine.infer_batch(Batch(tensors={**batch.tensors, ROUTED_EXPERTS: col}))[
            "log_probs"
        ]
    finally:
        engine.close()
    mask = batch["loss_mask"].bool()
    rollout = batch["rollout_log_probs"]
    gap_plain = float((base - rollout)[mask].abs().mean())
    gap_replay = float((replay - rollout)[mask].abs().mean())
    print(
        f"\nR3: mean |rollout - trainer| log-prob over {int(mask.sum())} response tokens: "
        f"{gap_plain:.6f} without replay, {gap_replay:.6f} with replay "
        f"({gap_replay / gap_plain:.2f}x)"
    )
    assert gap_replay <= 0.5 * gap_plain


def test_aux_loss_is_added_to_the_policy_loss(moe_dir):
    from polyrl.workers.rl_losses import actor_loss

    engine = build_engine(moe_dir)
    try:
        batch = build_rollout_batch(_prompts(4, seed=3), [p[:6] for p in _prompts(4, seed=4)], 0)
        batch.tensors["advantages"] = torch.ones_like(batch["loss_mask"])

        def router_grad(coef: float) -> tuple[dict, torch.Tensor]:
            engine.zero_grad()
            metrics = engine.forward_backward(
                batch, lambda o, mb: actor_loss(o, mb, router_aux_loss_coef=coef)
            )
            router = next(
                p for n, p in engine.model.named_parameters() if n.endswith("gate.weight")
            )
            return metrics, router.grad.full_tensor().clone()

        plain, g0 = router_grad(0.0)
        with_aux, g1 = router_grad(0.5)
    finally:
        engine.close()
    assert "router_aux_loss" not in plain
    # 1 at uniform load; random routers are close to it, never below.
    assert 1.0 <= with_aux["router_aux_loss"] < 2.0
    assert with_aux["loss"] == pytest.approx(
        plain["loss"] + 0.5 * with_aux["router_aux_loss"], rel=1e-4
    )
    assert (g1 - g0).abs().max() > 0


@pytest.mark.filterwarnings("ignore::polyrl.config.ConfigNote")
def test_rollout_batch_lays_out_routes_and_config_maps_verl_keys():
    from polyrl.config import ConfigError, load_config
    from polyrl.core.rollout_batch import widen_rollout_batch
    from polyrl.trainer.rl.checks import check_config

    r0 = [[[1, 2]], [[3, 4]], [[5, 6]], [[-1, -1]]]  # prompt of 2 + response of 2, 1 layer
    r1 = [[[7, 0]], [[1, 1]], [[-1, -1]]]  # prompt of 1 + response of 2 (last never fed)
    batch = build_rollout_batch([[5, 6], [7]], [[8, 9], [10, 11]], 0, routed_experts=[r0, r1])
    col = batch[ROUTED_EXPERTS]
    assert col.shape == (2, 4, 1, 2)
    assert col[0].tolist() == r0
    assert col[1].tolist() == [[[-1, -1]], *r1]
    wide = widen_rollout_batch(batch, 3, 3, 0)
    assert wide[ROUTED_EXPERTS][0, 1:5].tolist() == r0

    cfg = load_config(None, ["actor_rollout_ref.actor.router_replay.mode=R3"])
    assert cfg.actor.router_replay is True
    cfg = load_config(None, ["actor_rollout_ref.rollout.enable_rollout_routing_replay=true"])
    assert cfg.actor.router_replay is True
    with pytest.raises(ValueError, match="R2"):
        load_config(None, ["actor_rollout_ref.actor.router_replay.mode=R2"])
    cfg = load_config(None, ["actor.router_replay=true", "agent.enable=true", "rollout.n=4"])
    with pytest.raises(ConfigError, match="agent.enable"):
        check_config(cfg, has_rows=True)


def _launch_ep(model_dir: str, out, world: int, ep: int, foreign: str = "") -> dict:
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "engine_scripts"))
    from engine_common import launch

    args = [model_dir, str(out), str(ep), *([foreign] if foreign else [])]
    codes = launch("moe_ep.py", args, world=world, timeout=300)
    assert codes == [0] * world, "\n".join(launch.last_logs)
    result = json.loads((out / "result.json").read_text())
    result["tensors"] = torch.load(out / "tensors.pt")
    return result


@pytest.mark.slow
def test_expert_parallel_matches_one_rank(moe_dir, tmp_path):
    """ep2 and ep2 x dp2 (gloo) against one rank: 3 optimizer steps with clipping.

    Each run also resumes its step-1 checkpoint in a fresh engine and exports a Hugging Face
    directory; the ep2 x dp2 run is refused the ep2 run's checkpoint (another mesh).
    """
    from safetensors.torch import load_file

    ref = _launch_ep(moe_dir, tmp_path / "w1", world=1, ep=1)
    for world, ep in ((2, 2), (4, 2)):
        foreign = str(tmp_path / "w2" / "ckpt") if world == 4 else ""
        got = _launch_ep(moe_dir, tmp_path / f"w{world}", world=world, ep=ep, foreign=foreign)
        for step in range(3):
            diff = (torch.tensor(got["logps"][step]) - torch.tensor(ref["logps"][step])).abs()
            assert diff.max() <= 1e-5, (world, ep, step, float(diff.max()))
            assert got["losses"][step] == pytest.approx(ref["losses"][step], rel=1e-4)
            assert got["norms"][step] == pytest.approx(ref["norms"][step], rel=1e-4)
        # The checkpoint (experts sharded over ep, with their Adam state) resumes exactly.
        for key in ("logps", "losses", "norms"):
            assert got[f"resumed_{key}"] == got[key][1:], (world, key)
        # named_tensors yields whole HF tensors, experts gathered from their ranks...
        assert set(got["tensors"]) == set(ref["tensors"])
        for name, tensor in ref["tensors"].items():
            assert got["tensors"][name].shape == tensor.shape, name
            assert (got["tensors"][name] - tensor).abs().max() < 1e-4, name
        # ...and so does the export, which transformers loads as the model it trained.
        exported = load_file(tmp_path / f"w{world}" / "hf" / "model.safetensors")
        assert set(exported) == set(got["tensors"])
        assert all(torch.equal(exported[k], got["tensors"][k]) for k in exported)
        assert torch.equal(
            dict(load_causal_lm(tmp_path / f"w{world}" / "hf").named_parameters())[
                "model.layers.0.mlp.experts.gate_up_proj"
            ].detach(),
            got["tensors"]["model.layers.0.mlp.experts.gate_up_proj"],
        )
    assert ref["tensors"]["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8
    # Resuming the ep2 checkpoint on ep2 x dp2 says which meshes differ.
    err = got["foreign_error"]
    assert err is not None and "'dp_shard': 2" in err and "'dp_shard': 4" in err, err
    assert "expert_parallel_size" in err


def test_routes_cross_the_http_schema_and_the_trainer_packs_them():
    from types import SimpleNamespace

    from polyrl.config import load_config
    from polyrl.rollout.client import GenerateResult
    from polyrl.rollout.routes.generation import parse_generate
    from polyrl.rollout.schemas import GenerateBody, check_body
    from polyrl.trainer.rl.rollout import RolloutProducer

    body = {"input_ids": [5, 6], "sampling_params": {"return_routed_experts": True}}
    check_body(GenerateBody, body, "/generate", parse_generate)
    (request,), *_ = parse_generate(body)
    assert request.params.return_routed_experts
    sample = SampleOutput(0, output_ids=[7], routed_experts=[[[1, 2]], [[3, 0]], [[-1, -1]]])
    wire = {"request_id": "r", "outputs": [sample.to_dict()]}
    parsed = GenerateResult.from_json(wire, "replica").outputs[0]
    assert parsed.routed_experts == sample.routed_experts

    cfg = load_config(None, ["actor.router_replay=true"])
    producer = SimpleNamespace(
        cfg=cfg, pad_id=0, tokenizer=SimpleNamespace(batch_decode=lambda rows, **_: [""] * 2)
    )
    assert RolloutProducer.sampling_params(producer, 2, 1.0, 0)["return_routed_experts"]
    result = SimpleNamespace(outputs=[sample, sample])
    item = {"input_ids": torch.tensor([5, 6])}
    batch, _ = RolloutProducer.pack_single_turn(producer, [item], [result])
    assert batch[ROUTED_EXPERTS][:, :3].tolist() == [sample.routed_experts] * 2
    sample.routed_experts = None
    with pytest.raises(RuntimeError, match="router_replay"):
        RolloutProducer.pack_single_turn(producer, [item], [result])
    producer.cfg = load_config(None, [])
    assert "return_routed_experts" not in RolloutProducer.sampling_params(producer, 2, 1.0, 0)


def test_replay_and_aux_loss_under_activation_checkpointing(moe_dir):
    """The routers run again in backward: they must replay the same routes, count once."""
    from polyrl.model_engine import EngineConfig, OptimizerConfig
    from polyrl.workers.rl_losses import actor_loss

    ps = _prompts(4, seed=11)
    batch = build_rollout_batch(ps, [p[:5] for p in _prompts(4, seed=12)], 0)
    batch.tensors["advantages"] = torch.ones_like(batch["loss_mask"])
    geometry = moe_geometry(load_causal_lm(moe_dir))
    g = torch.Generator().manual_seed(0)
    shape = (*batch["input_ids"].shape, geometry.layers, geometry.top_k)
    # Arbitrary routes (not the model's own): any difference in recompute would show.
    batch.tensors[ROUTED_EXPERTS] = torch.randint(0, geometry.experts, shape, generator=g)
    results = []
    for checkpointing in (False, True):
        engine = build_engine(
            moe_dir, EngineConfig(gradient_checkpointing=checkpointing), OptimizerConfig()
        )
        try:
            metrics = engine.forward_backward(
                batch, lambda o, mb: actor_loss(o, mb, router_aux_loss_coef=0.1)
            )
            grads = {
                n: p.grad.full_tensor().clone()
                for n, p in engine.model.named_parameters()
                if p.grad is not None
            }
        finally:
            engine.close()
        results.append((metrics, grads))
    (m0, g0), (m1, g1) = results
    for key in ("loss", "router_aux_loss", "moe/load_max", "moe/load_min"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-6), key
    assert set(g0) == set(g1)
    assert max((g0[n] - g1[n]).abs().max() for n in g0) < 1e-6
