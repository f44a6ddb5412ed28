"""Sender/receiver core: bucketing, splitting, checksums, versions, bounded buffers."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.weights import (
    BucketMeta,
    Transport,
    WeightReceiver,
    WeightSender,
    WeightTransferError,
    create_transport,
    registered_transports,
)


class LoopbackTransport(Transport):
    """Delivers buckets straight into a receiver in this process (byte copies, like shm)."""

    def __init__(self, receiver: WeightReceiver, corrupt_bucket: int | None = None):
        self.receiver = receiver
        self.corrupt_bucket = corrupt_bucket
        self.buffers: dict[int, bytearray] = {}
        self.in_flight = 0
        self.max_in_flight = 0

    def begin(self, transfer_id: str, version: int) -> list[int]:
        return [self.receiver.begin(transfer_id, version)]

    def buffer(self, slot: int, nbytes: int) -> memoryview:
        assert slot in (0, 1)
        buf = self.buffers.setdefault(slot, bytearray(nbytes))
        return memoryview(buf)

    def send_bucket(self, slot: int, meta: BucketMeta) -> Callable[[], None]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        data = bytearray(self.buffers[slot][: meta.nbytes])
        if meta.index == self.corrupt_bucket and data:
            data[0] ^= 0xFF

        def wait() -> None:
            self.in_flight -= 1
            self.receiver.receive(meta, memoryview(data))

        return wait

    def commit(self, transfer_id: str, version: int, buckets: int) -> list[int]:
        return [self.receiver.commit(transfer_id, version, buckets)]

    def abort(self, transfer_id: str) -> None:
        self.receiver.abort(transfer_id)


class Store:
    """A stand-in serving model: a dict switched in one assignment."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.version = 0

    def load(self, pairs: list[tuple[str, torch.Tensor]], version: int) -> int:
        self.weights = dict(pairs)
        self.version = self.version + 1 if version < 0 else version
        return self.version


def make(corrupt: int | None = None):
    store = Store()
    receiver = WeightReceiver(store.load, lambda: store.version)
    return store, receiver, LoopbackTransport(receiver, corrupt)


shapes = st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1, max_size=6)


@settings(max_examples=30, deadline=None)
@given(shapes=shapes, bucket=st.sampled_from([64, 100, 256, 4096]), bf16=st.booleans())
def test_roundtrip_any_shapes_and_bucket_sizes(shapes, bucket, bf16):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i}.w": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
    tensors["ids"] = torch.arange(7, dtype=torch.int64)
    store, _, transport = make()
    dtype = torch.bfloat16 if bf16 else None
    sender = WeightSender(transport, bucket_mb=bucket / 2**20, dtype=dtype, checksum=True)
    stats = sender.send(iter(tensors.items()))
    assert stats.replica_versions == [1] and store.version == 1
    assert set(store.weights) == set(tensors)
    for name, t in tensors.items():
        want = t.to(dtype) if (dtype and t.is_floating_point()) else t
        assert store.weights[name].dtype == want.dtype
        assert torch.equal(store.weights[name], want), name
    # Two staging buffers of one bucket each, never more than two buckets in flight.
    assert stats.buffer_bytes <= 2 * max(bucket, 64)
    assert transport.max_in_flight <= 2
    assert stats.bytes == sum(
        (v.to(dtype) if dtype and v.is_floating_point() else v).numel()
        * (v.to(dtype) if dtype and v.is_floating_point() else v).element_size()
        for v in tensors.values()
    )


def test_large_tensor_is_split_across_buckets():
    store, _, transport = make()
    big = torch.randn(1000)
    stats = WeightSender(transport, bucket_mb=512 / 2**20).send([("big", big), ("b", big[:3])])
    assert stats.buckets == 8  # 4012 bytes / 512
    assert torch.equal(store.weights["big"], big)


def test_checksum_mismatch_names_tensors_and_keeps_old_version():
    store, receiver, transport = make(corrupt=1)
    tensors = [(f"t{i}", torch.full((16,), float(i))) for i in range(6)]
    with pytest.raises(WeightTransferError, match=r"checksum mismatch in bucket 1 .*t\d"):
        WeightSender(transport, bucket_mb=128 / 2**20, checksum=True).send(tensors)
    assert store.version == 0 and store.weights == {}
    assert receiver.status()["transfer_id"] is None  # the sender aborted the staging


def test_stale_version_and_superseded_transfer_are_clear_errors():
    store, receiver, transport = make()
    WeightSender(transport).send([("a", torch.ones(2))], version=3)
    assert store.version == 3
    with pytest.raises(WeightTransferError, match="version 3 is already serving"):
        WeightSender(transport).send([("a", torch.ones(2))], version=2)
    receiver.begin("old", 5)
    receiver.begin("new", 5)
    with pytest.raises(WeightTransferError, match="transfer old is not in progress"):
        receiver.commit("old", 5)


def test_incomplete_transfer_is_refused_by_name():
    store, receiver, _ = make()
    receiver.begin("x", 1)
    meta = BucketMeta.from_dict(
        {
            "transfer_id": "x",
            "version": 1,
            "index": 0,
            "nbytes": 8,
            "tensors": [{"name": "w", "shape": [4], "dtype": "float32", "offset": 0, "nbytes": 8}],
        }
    )
    receiver.receive(meta, memoryview(bytearray(8)))
    with pytest.raises(WeightTransferError, match=r"incomplete tensors \['w'\]"):
        receiver.commit("x", 1)
    assert store.version == 0


def test_name_map_hook_and_registry():
    store = Store()
    receiver = WeightReceiver(
        store.load, lambda: store.version, name_map=lambda n, t: [(n.upper(), t * 2)]
    )
    WeightSender(LoopbackTransport(receiver)).send([("w", torch.ones(3))])
    assert torch.equal(store.weights["W"], torch.full((3,), 2.0))
    assert {"shm", "dist", "disk", "cuda_ipc"} <= set(registered_transports())
    if not torch.cuda.is_available():
        with pytest.raises(WeightTransferError, match="cuda_ipc transport needs a CUDA device"):
            create_transport("cuda_ipc", urls=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="unknown weight transport 'nope'"):
        create_transport("nope")
    with pytest.raises(ValueError, match="bucket_mb must be > 0"):
        WeightSender(LoopbackTransport(receiver), bucket_mb=0)
