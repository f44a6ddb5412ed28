"""``SafetensorsDirTarget``: a transfer staged as a safetensors directory, reloaded once.

The backend here reloads with the same reader the vLLM worker extension runs
(``polyrl.rollout.vllm_ext.iter_safetensors_dir``), so what it sees is what vLLM would read; the
vLLM end-to-end test is ``tests_vllm/test_vllm_weights.py``.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_weights_core import LoopbackTransport

from polyrl.models.loader import checkpoint_shapes
from polyrl.rollout.vllm_ext import iter_safetensors_dir
from polyrl.weights import WeightReceiver, WeightSender, WeightTransferError
from polyrl.weights.staging import SafetensorsDirTarget


class DirBackend:
    """A backend that, like vLLM, only reloads whole safetensors directories."""

    weight_receive = "safetensors_dir"

    def __init__(self, model_dir: Path, tied: bool):
        self.model_dir = model_dir
        self.tied = tied
        self.weight_version = 0
        self.weights: dict[str, torch.Tensor] = {}
        self.reloads: list[str] = []
        self.mapped_at_reload: list[str] = []
        self.calls: list[str] = []

    async def update_weights(self, path: str, version: int | None = None) -> int:
        # Nothing may still be mapped by the receiver when the reload reads the files.
        with open("/proc/self/maps") as f:
            self.mapped_at_reload = [line for line in f if path in line]
        self.weights = {n: t.clone() for n, t in iter_safetensors_dir(path, self.tied)}
        self.reloads.append(path)
        self.weight_version = self.weight_version + 1 if version is None else version
        return self.weight_version

    async def abort(self, ids) -> int:
        self.calls.append("abort")
        return 0

    async def pause(self) -> None:
        self.calls.append("pause")

    async def resume(self) -> None:
        self.calls.append("resume")


def checkpoint(tmp_path: Path, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=gen),
        "model.layers.0.mlp.up_proj.weight": torch.randn(40, 16, generator=gen),
        "model.layers.0.input_layernorm.weight": torch.randn(16, generator=gen),
        "model.norm.weight": torch.randn(16, generator=gen),
    }


def setup(tmp_path: Path, loop, tied: bool = True):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file(checkpoint(tmp_path, 0), str(model_dir / "model.safetensors"))
    backend = DirBackend(model_dir, tied)
    root = tmp_path / "staging"

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    target = SafetensorsDirTarget(backend, run, staging_root=root)
    receiver = WeightReceiver(target)
    return backend, target, root, LoopbackTransport(receiver)


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
def test_staged_directory_is_reloaded_once_with_every_tensor(tmp_path, loop, wire):
    backend, target, root, transport = setup(tmp_path, loop)
    new = checkpoint(tmp_path, 1)
    # 1 KiB buckets: the embedding (4 KiB) is split over several buckets.
    sender = WeightSender(transport, bucket_mb=1024 / 2**20, dtype=wire, checksum=True)
    stats = sender.send(iter(new.items()), version=5)
    assert stats.replica_versions == [5] and backend.weight_version == 5
    assert len(backend.reloads) == 1 and stats.buckets >= 4
    assert backend.mapped_at_reload == []  # every mapping was dropped before the reload
    assert set(backend.weights) == {*new, "lm_head.weight"}  # the tied head, as vLLM gets it
    for name, tensor in new.items():
        want = tensor.to(wire) if wire is not None else tensor
        assert backend.weights[name].dtype == want.dtype
        assert torch.equal(backend.weights[name], want), name
    assert torch.equal(backend.weights["lm_head.weight"], backend.weights[next(iter(new))])
    assert not Path(backend.reloads[0]).exists() and list(root.iterdir()) == []
    assert target.held_bytes() == 0
    # The next update (default version: current + 1) reuses nothing stale.
    sender.send(iter(checkpoint(tmp_path, 2).items()))
    assert backend.weight_version == 6 and len(backend.reloads) == 2


def test_interrupted_transfer_never_reloads(tmp_path, loop):
    backend, target, root, transport = setup(tmp_path, loop)
    # What a server killed mid-transfer left behind is swept at the next begin; a live
    # process's directory is not.
    root.mkdir()
    (root / "polyrl-stage-999999999-abc-x").mkdir()  # above any pid_max: no such process
    (root / f"polyrl-stage-{os.getpid()}-live-x").mkdir()

    def dies():
        items = list(checkpoint(tmp_path, 1).items())
        yield from items[:2]
        raise RuntimeError("sender died")

    sender = WeightSender(transport, bucket_mb=1024 / 2**20, checksum=True, inflight="pause")
    with pytest.raises(RuntimeError, match="sender died"):
        sender.send(dies())
    assert backend.reloads == [] and backend.weight_version == 0
    # The transfer's own staging directory is gone, and so is the dead process's.
    assert [p.name for p in root.iterdir()] == [f"polyrl-stage-{os.getpid()}-live-x"]
    assert backend.calls == ["pause", "resume"]  # what the transfer paused is resumed


def test_unknown_wrong_shape_and_missing_tensors_are_named(tmp_path, loop):
    backend, target, root, transport = setup(tmp_path, loop)
    sender = WeightSender(transport, bucket_mb=1024 / 2**20)
    new = checkpoint(tmp_path, 1)
    with pytest.raises(WeightTransferError, match="unknown tensor 'model.bogus.weight'"):
        sender.send(iter([*new.items(), ("model.bogus.weight", torch.zeros(3))]))
    with pytest.raises(WeightTransferError, match=r"'model.norm.weight' has shape \[8\]"):
        sender.send(iter([*list(new.items())[:3], ("model.norm.weight", torch.zeros(8))]))
    with pytest.raises(WeightTransferError, match=r"missing .*'model.norm.weight'"):
        sender.send(iter(list(new.items())[:3]))
    assert backend.reloads == [] and backend.weight_version == 0
    assert list(root.iterdir()) == []
    assert set(checkpoint_shapes(backend.model_dir)) == set(new)
