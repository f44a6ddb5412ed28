"""Sender/receiver core: bucketing, splitting, checksums, versions, bounded buffers."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.core.dtypes import DTYPE_SIZES, FLOAT_DTYPES, resolve_dtype
from polyrl.core.rollout_api import EngineUnavailableError, GenerateRequest, SamplingParams
from polyrl.models.loader import load_causal_lm
from polyrl.rollout.native.engine import NativeEngine, NativeEngineConfig
from polyrl.weights import (
    BucketMeta,
    LoadFnTarget,
    Transport,
    WeightReceiver,
    WeightSender,
    WeightTransferError,
    create_transport,
    registered_transports,
)
from polyrl.weights.base import align_up, dtype_from_name, dtype_name
from polyrl.weights.server_routes import EngineTarget


class LoopbackTransport(Transport):
    """Delivers buckets straight into a receiver in this process (byte copies, like shm)."""

    def __init__(self, receiver: WeightReceiver, corrupt_bucket: int | None = None):
        self.receiver = receiver
        self.corrupt_bucket = corrupt_bucket
        self.buffers: dict[int, torch.Tensor] = {}
        self.in_flight = 0
        self.max_in_flight = 0

    def begin(self, transfer_id: str, version: int, options=None) -> list[int]:
        return [self.receiver.begin(transfer_id, version, **dict(options or {}))]

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        assert slot in (0, 1)
        buf = self.buffers.setdefault(slot, torch.empty(nbytes, dtype=torch.uint8))
        return buf[:nbytes]

    def send_bucket(self, slot: int, meta: BucketMeta) -> Callable[[], None]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        data = bytearray(self.buffers[slot][: meta.nbytes].numpy().tobytes())
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
    receiver = WeightReceiver(LoadFnTarget(store.load, lambda: store.version))
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
    assert stats.buffer_bytes <= 2 * align_up(max(bucket, 64))  # buckets are 16-byte aligned
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


def test_a_chunk_arriving_twice_is_refused_by_name():
    store, receiver, _ = make()
    receiver.begin("x", 1)

    def bucket(index: int) -> BucketMeta:
        entry = {"name": "w", "shape": [2], "dtype": "float32", "offset": 0, "nbytes": 8}
        meta = {"transfer_id": "x", "version": 1, "index": index, "nbytes": 8}
        return BucketMeta.from_dict({**meta, "tensors": [entry]})

    receiver.receive(bucket(0), memoryview(bytearray(8)))  # "w" is complete
    with pytest.raises(WeightTransferError, match="'w' receives more than its 8 bytes"):
        receiver.receive(bucket(1), memoryview(bytearray(8)))


def test_name_map_hook_and_registry():
    store = Store()
    receiver = WeightReceiver(
        LoadFnTarget(store.load, lambda: store.version), name_map=lambda n, t: [(n.upper(), t * 2)]
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


# ---------------------------------------------------------------------------------------------
# A real native engine behind the receiver: staging modes and in-flight policies.

OPTS = {"num_threads": 1, "max_num_seqs": 8, "max_num_batched_tokens": 64}
LONG = SamplingParams(max_new_tokens=4000, temperature=0, ignore_eos=True)


class _Backend:
    """What the weight routes see of the native backend: ``engine`` and ``weight_version``."""

    def __init__(self, engine: NativeEngine):
        self.engine = engine

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version


@pytest.fixture
def native(tiny_qwen2_dir, tiny_qwen2_seed1_dir):
    engine = NativeEngine(tiny_qwen2_dir, NativeEngineConfig(**OPTS))
    engine.start()
    receiver = WeightReceiver(EngineTarget(_Backend(engine)))
    new = dict(load_causal_lm(tiny_qwen2_seed1_dir).named_parameters())
    try:
        yield engine, receiver, new
    finally:
        engine.shutdown()


def _stream(engine: NativeEngine, rid: str, params: SamplingParams = LONG):
    """Submit a request; return (deltas list, finished event)."""
    deltas, done = [], threading.Event()

    def sink(payload):
        if isinstance(payload, BaseException):
            done.set()
            return
        for d in payload:
            deltas.append(d)
            if d.finish_reason:
                done.set()

    engine.submit(GenerateRequest(rid, (3, 14, 15, 92, 65), params), sink, stream=True)
    while not deltas and not done.wait(0.01):
        pass
    return deltas, done


def _greedy(engine: NativeEngine) -> list[int]:
    deltas, done = _stream(
        engine, uuid.uuid4().hex, SamplingParams(max_new_tokens=6, temperature=0)
    )
    assert done.wait(30)
    return [t for d in deltas for t in d.token_ids]


def test_staged_keep_decodes_through_the_update_and_swaps_without_copies(native):
    engine, receiver, new = native
    deltas, done = _stream(engine, "long")
    before = {n: p.data_ptr() for n, p in engine.runner.model.named_parameters()}
    sender = WeightSender(LoopbackTransport(receiver), bucket_mb=0.05, checksum=True)
    stats = sender.send(iter(new.items()))
    assert stats.replica_versions == [1] and engine.weight_version == 1
    assert not done.is_set()  # kept running through the transfer
    engine.abort(["long"]).result()
    assert done.wait(30)
    assert deltas[0].weight_version == 0 and deltas[-1].weight_version == 1
    # The switch swapped storage (no copy), and the old storage became the next shadow.
    after = {n: p.data_ptr() for n, p in engine.runner.model.named_parameters()}
    assert all(before[n] != after[n] for n in before)
    held = receiver.status()["held_bytes"]
    assert held == sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    for name, param in engine.runner.model.named_parameters():
        assert torch.equal(param, new[name]), name
    # Transfer memory beyond the shadows: none (loopback hands over its own bytes).
    assert receiver.status()["last"]["peak_extra_bytes"] == 0


def test_abort_policy_ends_inflight_requests(native):
    engine, receiver, new = native
    deltas, done = _stream(engine, "long")
    WeightSender(LoopbackTransport(receiver), inflight="abort").send(iter(new.items()))
    assert done.wait(30) and deltas[-1].finish_reason == "abort"
    assert deltas[-1].weight_version == 0 and engine.weight_version == 1
    assert not engine.paused


def test_inplace_pauses_refuses_and_an_interrupted_update_blocks_until_a_retry(native):
    engine, receiver, new = native
    old = {n: p.detach().clone() for n, p in engine.runner.model.named_parameters()}
    deltas, done = _stream(engine, "long")
    seen = []

    def during(meta):
        seen.append(engine.paused)
        with pytest.raises(EngineUnavailableError, match="in-place weight update"):
            engine.submit(GenerateRequest("x", (1, 2)), lambda p: None)

    transport = LoopbackTransport(receiver)
    ptrs = {n: p.data_ptr() for n, p in engine.runner.model.named_parameters()}
    WeightSender(transport, bucket_mb=0.05, mode="inplace", on_bucket=during).send(
        iter(new.items())
    )
    assert seen and all(seen)  # paused for the whole transfer
    assert engine.weight_version == 1 and not engine.paused and not done.is_set()
    assert {n: p.data_ptr() for n, p in engine.runner.model.named_parameters()} == ptrs
    assert receiver.status()["held_bytes"] == 0  # no shadow: bounded memory
    engine.abort(["long"]).result()

    # Interrupted: the live weights are mixed, so requests get a clear 503 until a retry.
    def die(meta):
        if meta.index == 2:
            raise KeyboardInterrupt  # the sender dies after two buckets

    with pytest.raises(KeyboardInterrupt):
        WeightSender(transport, bucket_mb=0.05, mode="inplace", on_bucket=die).send(
            iter(old.items())
        )
    assert engine.weight_version == 1
    with pytest.raises(EngineUnavailableError, match="interrupted.*still version 1"):
        _greedy(engine)
    WeightSender(transport, bucket_mb=0.05, mode="inplace").send(iter(old.items()))
    assert engine.weight_version == 2 and not engine.paused
    for name, param in engine.runner.model.named_parameters():
        assert torch.equal(param, old[name]), name
    assert len(_greedy(engine)) == 6


def test_stalled_transfer_is_dropped_and_unknown_tensor_is_named(native):
    engine, receiver, new = native
    receiver.begin("t1", -1, inflight="pause", stall_timeout=0.3)
    assert engine.paused
    deadline = time.monotonic() + 10
    while receiver.status()["transfer_id"] is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver.status()["last"]["outcome"].startswith("aborted: no bucket")
    assert not engine.paused and engine.weight_version == 0
    bad = iter([("model.nope.weight", torch.zeros(3)), *new.items()])
    with pytest.raises(Exception, match="model.nope.weight"):
        WeightSender(LoopbackTransport(receiver)).send(bad)
    missing = iter(list(new.items())[:-1])
    with pytest.raises(Exception, match=r"parameter\(s\) missing"):
        WeightSender(LoopbackTransport(receiver)).send(missing)
    assert engine.weight_version == 0 and not engine.paused
    # bf16 on the wire into fp32 parameters converts while copying (no extra staging).
    WeightSender(LoopbackTransport(receiver), dtype=torch.bfloat16, bucket_mb=0.01).send(
        iter(new.items())
    )
    for name, param in engine.runner.model.named_parameters():
        assert torch.equal(param, new[name].to(torch.bfloat16).float()), name


def test_direct_writes_into_the_offered_arena_are_checked_at_commit(native):
    from polyrl.core.arena import ArenaWriter
    from polyrl.weights.base import bucket_checksum

    engine, receiver, new = native
    serving = {n: p.detach().clone() for n, p in engine.runner.model.named_parameters()}

    def write_all(transfer_id: str) -> tuple[ArenaWriter, dict[str, int | None]]:
        offer = receiver.offer_direct(transfer_id)
        assert offer is not None and set(offer["tensors"]) >= set(new)
        writer = ArenaWriter(offer["path"])
        crcs = {}
        for name, tensor in new.items():
            offset, shape, _ = offer["tensors"][name]
            assert tuple(shape) == tuple(tensor.shape)
            crcs[name] = writer.write(offset, tensor.detach().reshape(-1), tensor.dtype, True)
            assert crcs[name] == bucket_checksum(tensor.detach().reshape(-1).view(torch.uint8))
        return writer, crcs

    # inplace: the live weights are never offered to another process.
    receiver.begin("t-inplace", -1, mode="inplace")
    assert receiver.offer_direct("t-inplace") is None
    receiver.abort("t-inplace")
    # A wrong checksum, then a name that was not offered: refused by name, old weights serve.
    for bad in ("crc", "name"):
        receiver.begin(f"t-{bad}", -1)
        writer, crcs = write_all(f"t-{bad}")
        first = next(iter(crcs))
        if bad == "crc":
            crcs[first] ^= 1
            match = f"checksum mismatch in tensor {first!r}"
        else:
            crcs["model.not_a_weight"] = None
            match = "'model.not_a_weight' was reported as written directly"
        with pytest.raises(WeightTransferError, match=match):
            receiver.commit(f"t-{bad}", -1, 0, direct=crcs)
        writer.close()
        assert engine.weight_version == 0
        for name, param in engine.runner.model.named_parameters():
            assert torch.equal(param, serving[name]), name
    receiver.begin("t-good", -1)
    writer, crcs = write_all("t-good")
    assert receiver.commit("t-good", -1, 0, direct=crcs) == 1
    writer.close()
    for name, param in engine.runner.model.named_parameters():
        assert torch.equal(param, new[name]), name
    assert receiver.status()["last"]["bytes"] == sum(
        t.numel() * t.element_size() for t in new.values()
    )


def test_control_channel_verifies_tls_only_where_a_replica_uses_it():
    import ssl

    from polyrl.weights.transports import ShmTransport

    # Plain-HTTP replicas skip the CA bundle (20-35 ms per transfer); any https URL keeps it.
    for urls, mode in (
        (["http://127.0.0.1:1", "http://127.0.0.1:2"], ssl.CERT_NONE),
        (["http://127.0.0.1:1", "HTTPS://rollout.example:8000"], ssl.CERT_REQUIRED),
    ):
        transport = ShmTransport(urls)
        try:
            assert transport._http._transport._pool._ssl_context.verify_mode == mode, urls
        finally:
            transport.close()


def test_the_dtype_table_names_sizes_and_resolves_every_dtype():
    for name, size in DTYPE_SIZES.items():
        dtype = dtype_from_name(name)
        assert dtype_name(dtype) == name and dtype.itemsize == size
    assert [resolve_dtype(n) for n in FLOAT_DTYPES] == [
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ]
    assert resolve_dtype("BF16") is torch.bfloat16 and resolve_dtype("half") is torch.float16
    assert resolve_dtype(torch.float64) is torch.float64
    with pytest.raises(ValueError, match="model.dtype: unknown dtype 'float8'"):
        resolve_dtype("float8", "model.dtype")
    with pytest.raises(ValueError, match="floating point"):
        resolve_dtype(torch.int8)
    with pytest.raises(WeightTransferError, match="cannot be transferred"):
        dtype_name(torch.complex64)
    with pytest.raises(WeightTransferError, match="unknown dtype 'torch.float32'"):
        dtype_from_name("torch.float32")
    # The table itself needs no torch: configs and the vLLM launcher read it.
    code = "import sys, polyrl.core.dtypes, polyrl.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
