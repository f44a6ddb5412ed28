"""Tensor and Ulysses sequence parallelism in the FSDP2 engine (polyrl.model_engine.parallel).

Parity runs use real gloo process groups: tests/engine_scripts/parallel_mesh.py trains a tiny
fp32 llama for three optimizer steps (SFT plus an entropy bonus) as 1 rank, then on dp2 x tp2,
dp2 x sp2 and sp4 meshes (4 ranks each); per-token log-probs, entropy, losses, gradient norms,
the whole tensors ``named_tensors`` yields and a value model's values and update must match the
single rank's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent / "engine_scripts"
sys.path.insert(0, str(HERE))

from engine_common import launch, tiny_model  # noqa: E402

from polyrl.model_engine.config import ParallelismConfig  # noqa: E402
from polyrl.model_engine.parallel.mesh import ParallelDims  # noqa: E402

LOGP_ATOL = 1e-5
RTOL = 1e-4


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    # Four key/value heads: sp4 needs them divisible by 4.
    out = tmp_path_factory.mktemp("tiny") / "llama"
    return tiny_model(out, arch="llama", hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128)


def _run(model_dir: str, out: Path, world: int, tp: int, sp: int, *extra: str) -> dict:
    codes = launch("parallel_mesh.py", [model_dir, str(out), str(tp), str(sp), *extra], world)
    os.environ.pop("PARALLEL_MESH_CHECKPOINTING", None)
    assert codes == [0] * world, "\n".join(launch.last_logs)  # type: ignore[attr-defined]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(llama_dir, tmp_path_factory) -> dict:
    return _run(llama_dir, tmp_path_factory.mktemp("ref") / "ref.json", 1, 1, 1)


def _max_abs(a: list, b: list) -> float:
    return (torch.tensor(a) - torch.tensor(b)).abs().max().item()


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# --------------------------------------------------------------------------- mesh and config
def test_parallel_dims_derive_dp_and_name_the_keys_when_they_do_not_fit():
    dims = ParallelDims.from_config(8, tp=2, sp=2)
    assert (dims.dp_shard, dims.sp, dims.tp, dims.shape) == (2, 2, 2, (2, 2, 2))
    assert ParallelDims.from_config(4).trivial
    with pytest.raises(
        ValueError, match="tensor_parallel_size=3 x ulysses_sequence_parallel_size=1"
    ):
        ParallelDims.from_config(4, tp=3)
    with pytest.raises(ValueError, match="expert_parallel_size=3 must divide"):
        ParallelDims.from_config(4, ep=3)
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size must be an int >= 1"):
        ParallelismConfig(ulysses_sequence_parallel_size=0)


def test_tensor_parallel_refuses_a_family_without_a_plan(tmp_path):
    from transformers import AutoModelForCausalLM

    from polyrl.model_engine.parallel.tensor import TP_FAMILIES, check_tp_family

    path = tiny_model(tmp_path / "moe", arch="qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError, match="no tensor-parallel plan for model family 'qwen3_moe'"):
        check_tp_family(model, 2)
    try:
        check_tp_family(model, 2)
    except ValueError as exc:
        assert all(f in str(exc) for f in TP_FAMILIES)


def test_ulysses_needs_heads_divisible_by_sp(tmp_path):
    from transformers import AutoModelForCausalLM

    from polyrl.model_engine.parallel.ulysses import enable_ulysses

    path = tiny_model(tmp_path / "q", arch="qwen2")  # 4 heads, 2 key/value heads
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"key/value heads \(2\)"):
        enable_ulysses(model, 4)


def test_vocab_parallel_log_probs_entropy_and_gradient(tmp_path):
    out = tmp_path / "vp.json"
    assert launch("vocab_parallel.py", [str(out)], 2) == [0, 0], "\n".join(launch.last_logs)
    for rank, offset in ((0, 0), (1, 4)):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        assert got["offset"] == offset
        # fp32 arithmetic against an fp64 reference.
        assert max(got["logp"], got["entropy"], got["grad"]) < 1e-6, got


# --------------------------------------------------------------------------- parity (4 ranks)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "sp", "mesh"),
    [
        (2, 1, {"dp_shard": 2, "sp": 1, "tp": 2, "ep": 1}),
        (1, 2, {"dp_shard": 2, "sp": 2, "tp": 1, "ep": 1}),
        (1, 4, {"dp_shard": 1, "sp": 4, "tp": 1, "ep": 1}),
        (2, 2, {"dp_shard": 1, "sp": 2, "tp": 2, "ep": 1}),
    ],
    ids=["dp2xtp2", "dp2xsp2", "sp4", "tp2xsp2_checkpointing"],
)
def test_parity_with_one_rank(llama_dir, reference, tmp_path, tp, sp, mesh):
    if tp == sp == 2:
        # Both axes at once, with activation checkpointing (the reference runs without).
        os.environ["PARALLEL_MESH_CHECKPOINTING"] = "1"
    # Checkpoints round-trip on the tensor-parallel and the pure sequence-parallel mesh.
    extra = [str(tmp_path / "ckpt")] if sp == 4 or tp == 2 else []
    got = _run(llama_dir, tmp_path / "out.json", 4, tp, sp, *extra)
    assert got["mesh"] == mesh
    dp_sp = mesh["dp_shard"] * mesh["sp"]
    assert got["expert_mesh"] == [["ep_replicate", "ep", "tp"], [dp_sp, 1, mesh["tp"]]]
    for ref, step in zip(reference["steps"], got["steps"], strict=True):
        assert _max_abs(step["logp"], ref["logp"]) <= LOGP_ATOL
        assert _max_abs(step["entropy"], ref["entropy"]) <= LOGP_ATOL
        assert _rel(step["loss"], ref["loss"]) <= RTOL
        assert _rel(step["grad_norm"], ref["grad_norm"]) <= RTOL
    assert _max_abs(got["final"]["logp"], reference["final"]["logp"]) <= LOGP_ATOL
    # The value model (critic): values gathered along the sequence, one step of updates.
    assert _max_abs(got["values"], reference["values"]) <= LOGP_ATOL
    assert _max_abs(got["values_after"], reference["values_after"]) <= LOGP_ATOL
    assert _rel(got["value_loss"], reference["value_loss"]) <= RTOL
    assert _rel(got["value_grad_norm"], reference["value_grad_norm"]) <= RTOL
    # named_tensors: the same Hugging Face names and whole shapes, the same values.
    assert sorted(got["tensors"]) == sorted(reference["tensors"])
    for name, (shape, total, abs_total) in reference["tensors"].items():
        g_shape, g_total, g_abs = got["tensors"][name]
        assert g_shape == shape, name
        assert abs(g_abs - abs_total) <= RTOL * abs_total, name
        assert abs(g_total - total) <= RTOL * abs_total, name
    if extra:
        # Save then resume on the same mesh: the same model.
        assert got["resumed"]["logp"] == got["final"]["logp"]
    if sp == 4:
        # Another mesh shape is refused, naming both.
        err = _run(llama_dir, tmp_path / "err.json", 4, 2, 2, extra[0], "load")["error"]
        assert err is not None
        assert "'sp': 4" in err and "'sp': 2, 'tp': 2" in err


def test_ulysses_masks_follow_packing_and_sliding_windows():
    from polyrl.model_engine.parallel import ulysses

    def expected(pos: torch.Tensor, window: int | None) -> torch.Tensor:
        seq = (pos == 0).cumsum(-1)[0]
        n = pos.shape[-1]
        out = torch.zeros(n, n, dtype=torch.bool)
        for q in range(n):
            for k in range(q + 1):
                out[q, k] = seq[q] == seq[k] and (window is None or q - k < window)
        return out

    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])
    with ulysses.ulysses_context(None, packed, "sdpa", real_length=7):
        assert torch.equal(ulysses._STATE.mask_for(None)[0, 0], expected(packed, None))
        assert torch.equal(ulysses._STATE.mask_for(2)[0, 0], expected(packed, 2))
    # One real sequence (the tail is padding): causal attention, no T x T mask...
    single = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1]])
    with ulysses.ulysses_context(None, single, "sdpa", real_length=6):
        assert ulysses._STATE.mask_for(None) is None
        # ...but a window shorter than the row still needs one.
        assert torch.equal(ulysses._STATE.mask_for(3)[0, 0], expected(single, 3))


def _tp2_workers(world: int) -> list:
    """``world`` EngineWorkers of a tp=2 mesh, each as its rank would be (no model built)."""
    from polyrl.controller import worker as worker_mod
    from polyrl.model_engine import EngineConfig
    from polyrl.workers.engine import EngineWorker

    engine = EngineConfig(device="cpu", parallelism=ParallelismConfig(tensor_parallel_size=2))
    workers = []
    for rank in range(world):
        ctx = worker_mod._standalone_context("EngineWorker")
        worker_mod._construction.ctx = dataclasses.replace(ctx, rank=rank, world_size=world)
        try:
            workers.append(EngineWorker(role="actor", model="/unused", engine=engine))
        finally:
            worker_mod._construction.ctx = None
    return workers


def test_engine_worker_gives_sp_and_tp_peers_the_same_rows():
    from polyrl.workers.engine import ENGINE_MESH

    infos = [w.dispatch_info(ENGINE_MESH) for w in _tp2_workers(4)]
    # (dp_rank, dp_size, is_collect): ranks 0, 1 share shard 0; 2, 3 shard 1.
    assert infos == [(0, 2, True), (0, 2, False), (1, 2, True), (1, 2, False)]


def test_only_the_collect_rank_of_a_tp_group_puts_outputs_to_the_queue():
    from polyrl.core.batch import Batch
    from polyrl.core.rollout_batch import build_rollout_batch
    from polyrl.trainer.rl.store_worker import sample_rows
    from polyrl.transfer import LocalTransferQueue
    from polyrl.workers.engine import ENGINE_MESH
    from polyrl.workers.store import StepLayout, StoredRows

    puts: list[tuple[str, tuple[int, ...]]] = []

    class CountingQueue(LocalTransferQueue):  # a real local queue that logs its puts
        def _put(self, batch, partition, sample_ids):
            puts.append((partition, tuple(sample_ids or ())))
            return super()._put(batch, partition, sample_ids)

    queue = CountingQueue()
    batch = build_rollout_batch([[3, 4]] * 4, [[5, 6, 7]] * 4, 0, [[-1.0, -2.0, -3.0]] * 4)
    batch["score"] = batch["acc"] = torch.zeros(4)
    queue.put(sample_rows(batch), "step-1")
    rows = StoredRows(queue.get_meta(["prompt_ids"], 4, "step-1", "t"), StepLayout(2, 3, 0))
    puts.clear()
    for worker in _tp2_workers(4):  # dp 2 x tp 2: each shard computed by two ranks
        worker.attach_transfer_queue(queue)
        dp_rank, dp_size, _ = worker.dispatch_info(ENGINE_MESH)
        shard = rows.__dp_chunks__(dp_size)[dp_rank]
        # The rank's inference (the same rows give tp peers the same output).
        worker._infer(shard, lambda got: Batch({"old_log_probs": got["input_ids"].float()}))
    # One put per data-parallel shard (ranks 0 and 2), not one per rank.
    assert puts == [("step-1", (0, 1)), ("step-1", (2, 3))]
    out = queue.get_data(queue.get_meta(["old_log_probs"], 4, "step-1", "t2"))
    assert torch.equal(out["old_log_probs"], batch["input_ids"].float())


def test_run_config_checks_tp_times_sp_against_the_world_size():
    from polyrl.config import ConfigError, load_config
    from polyrl.trainer.rl.checks import check_config

    cfg = load_config(
        "grpo",
        ["trainer.n_gpus_per_node=4", "actor.tensor_parallel_size=3", "model.path=/models/x"],
    )
    with pytest.raises(ConfigError, match=r"actor.tensor_parallel_size.*trainer.world_size \(4\)"):
        check_config(cfg, has_model=True)
