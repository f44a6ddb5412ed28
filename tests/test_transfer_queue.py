"""Tests of polyrl.transfer: the local backend, the samplers, and the Ray backend."""

from __future__ import annotations

import os
import pickle
import threading
import time

import numpy as np
import pytest
import torch
from waiting import wait_until

from polyrl.core.batch import Batch
from polyrl.core.columns import MULTI_MODAL
from polyrl.core.multimodal import MultiModalInputs, encode_png, image_digest
from polyrl.transfer import (
    BatchMeta,
    LocalTransferQueue,
    SampleInfo,
    TransferError,
    get_sampler,
    make_transfer_queue,
)
from polyrl.transfer._core import value_nbytes


def _batch(n: int, seed: int = 0, start: int = 0, group_size: int = 1, seq: int = 6) -> Batch:
    """A batch with tensor columns of several dtypes and ragged/object columns."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (n,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).to(torch.int64)
    return Batch(
        {
            "input_ids": torch.randint(0, 1000, (n, seq), generator=g, dtype=torch.int64),
            "attention_mask": mask,
            "log_probs": torch.randn(n, seq, generator=g),
            "hidden": torch.randn(n, 2, 3, generator=g).to(torch.bfloat16),
            "flag": torch.rand(n, generator=g) > 0.5,
        },
        {
            "response_ids": [torch.arange(int(k)) + i for i, k in enumerate(lengths)],
            "prompt": [f"prompt {start + i}" for i in range(n)],
            "np_ragged": [np.arange(i % 3 + 1, dtype=np.int32) for i in range(n)],
            "uid": [f"g{(start + i) // group_size}" for i in range(n)],
        },
    )


# ----------------------------------------------------------------------------------------------
# BatchMeta
# ----------------------------------------------------------------------------------------------
def test_batch_meta_chunk_index_concat_and_pickle_small():
    meta = BatchMeta("p", range(7), ("a",), [0] * 7, ["x"] * 7, range(7))
    parts = meta.chunk(3)
    assert [len(p) for p in parts] == [3, 2, 2]
    assert [p.sample_ids for p in parts] == [(0, 1, 2), (3, 4), (5, 6)]
    assert BatchMeta.concat(parts) == meta
    assert [len(p) for p in meta[:2].chunk(4)] == [1, 1, 0, 0]
    assert meta[[6, 0]].sample_ids == (6, 0) and meta[[6, 0]].lengths == (6, 0)
    assert meta[1:3].groups == ("x", "x")
    assert len(pickle.dumps(meta)) < 400
    with pytest.raises(ValueError, match="one partition"):
        BatchMeta.concat([meta, BatchMeta.empty("q")])
    with pytest.raises(ValueError, match="units has 1 entries, expected 2"):
        BatchMeta("p", (0, 1), (), (0,), (None, None), (0, 0))
    with pytest.raises(IndexError, match="out of range"):
        meta[[7]]


# ----------------------------------------------------------------------------------------------
# Local backend: data
# ----------------------------------------------------------------------------------------------
def test_local_round_trip_is_exact_for_every_dtype_and_object_column():
    q = LocalTransferQueue()
    b1, b2 = _batch(5, seed=1), _batch(3, seed=2, start=5)
    m1 = q.put(b1, "step0")
    m2 = q.put(b2, "step0")
    assert m1.sample_ids == (0, 1, 2, 3, 4) and m2.sample_ids == (5, 6, 7)
    assert set(m1.fields) == set(b1.keys())
    assert m1.lengths == tuple(b1["attention_mask"].sum(1).tolist())
    assert m1.groups == tuple(f"g{i}" for i in range(5))
    got = q.get_data(BatchMeta.concat([m1, m2]))
    assert got.equals(Batch.concat([b1, b2]))
    assert got["hidden"].dtype == torch.bfloat16 and got["flag"].dtype == torch.bool
    assert isinstance(got.non_tensors["response_ids"][0], torch.Tensor)
    # Arbitrary order and a subset of fields.
    sub = q.get_data(BatchMeta.concat([m2, m1])[[3, 0]], fields=["log_probs", "prompt"])
    assert sub.keys() == ["log_probs", "prompt"]
    assert torch.equal(sub["log_probs"], torch.stack([b1["log_probs"][0], b2["log_probs"][0]]))
    assert list(sub["prompt"]) == ["prompt 0", "prompt 5"]
    # What was returned does not alias the store, and the store did not alias the input.
    got["input_ids"].zero_()
    b1["log_probs"].zero_()
    again = q.get_data(m1)
    assert not torch.equal(again["input_ids"], torch.zeros_like(again["input_ids"]))
    assert again["log_probs"].abs().sum() > 0


def test_local_ragged_tensor_field_across_puts_comes_back_as_object_column():
    q = LocalTransferQueue()
    q.put(Batch({"x": torch.ones(2, 3)}), "p")
    q.put(Batch({"x": torch.zeros(2, 5)}), "p")
    meta = q.get_meta(["x"], 4, "p", "c")
    got = q.get_data(meta)
    assert got.non_tensor_keys == ["x"]
    assert [tuple(v.shape) for v in got["x"]] == [(3,), (3,), (5,), (5,)]
    # Rows of one shape stack again.
    got2 = q.get_data(meta[:2])
    assert got2.tensor_keys == ["x"] and torch.equal(got2["x"], torch.ones(2, 3))


def test_local_put_adds_and_overwrites_fields_of_existing_and_new_samples():
    q = LocalTransferQueue()
    q.put(_batch(4), "p")
    adv = torch.arange(4, dtype=torch.float32)
    meta = q.put(Batch({"adv": adv[[2, 0]]}), "p", sample_ids=[2, 0])
    assert meta.sample_ids == (2, 0) and meta.fields == ("adv",)
    # The length and group of existing samples are kept when the put has no such columns.
    assert meta.groups == ("g2", "g0") and meta.lengths[0] > 0
    with pytest.raises(TransferError, match=r"field 'adv' .* missing for sample ids \[1, 3\]"):
        q.get_data(BatchMeta("p", (0, 1, 2, 3), ("adv",), (0,) * 4, (None,) * 4, (0,) * 4))
    got = q.get_meta(["input_ids", "adv"], None, "p", "c")
    assert got.sample_ids == (0, 2)
    assert torch.equal(q.get_data(got)["adv"], torch.tensor([0.0, 2.0]))
    # Overwrite, and create a new sample with an explicit id (ids continue after it).
    q.put(Batch({"adv": torch.tensor([9.0, 7.0])}), "p", sample_ids=[0, 10])
    m = q.get_meta(["adv"], None, "p", "c2")
    assert m.sample_ids == (0, 2, 10)
    assert q.get_data(m)["adv"].tolist() == [9.0, 2.0, 7.0]
    assert q.put(Batch({"adv": torch.zeros(1)}), "p").sample_ids == (11,)


def test_local_clear_frees_storage_and_metadata():
    q = LocalTransferQueue()
    b = _batch(8)
    q.put(b, "a")
    q.put(b, "b")
    per = q.status()["storage_bytes"] // 2
    tensor_bytes = sum(t.numel() * t.element_size() for t in b.tensors.values())
    assert per >= tensor_bytes
    # Overwriting every sample's field releases the old chunk.
    q.put(Batch({"log_probs": torch.zeros(8, 6)}), "a", sample_ids=range(8))
    assert q.storage_bytes() == 2 * per
    q.clear("a")
    assert q.storage_bytes() == per
    st = q.status()
    assert list(st["partitions"]) == ["b"] and st["units"] == [per]
    q.clear("b")
    assert q.storage_bytes() == 0
    with pytest.raises(TransferError, match="unknown partition 'a'"):
        q.get_data(BatchMeta("a", (0,), ("input_ids",), (0,), (None,), (0,)))
    # A cleared partition starts again from id 0.
    assert q.put(_batch(2), "a").sample_ids == (0, 1)


def _prompt_media(seed: int) -> MultiModalInputs:
    """One prompt's processed image, as a vision processor leaves it (tensors plus the PNG)."""
    from PIL import Image

    image = Image.new("RGB", (28, 28), (seed * 40 % 256, 90, 200))
    g = torch.Generator().manual_seed(seed)
    return MultiModalInputs(
        tensors={
            "pixel_values": torch.randn(16, 1176, generator=g),
            "image_grid_thw": torch.tensor([[1, 4, 4]]),
        },
        kinds=("image",),
        digests=(image_digest(image),),
        token_counts=(4,),
        sources=(encode_png(image),),
    )


def _vl_rows(media: list[MultiModalInputs], n: int, copies: bool) -> Batch:
    """``n`` sample rows per prompt; ``copies``: each row holds its own equal copy of the media
    (as rows do that crossed processes separately), else the prompt's one object."""
    column = [pickle.loads(pickle.dumps(m)) if copies else m for m in media for _ in range(n)]
    rows = len(column)
    return Batch({"input_ids": torch.arange(rows * 5).view(rows, 5)}, {MULTI_MODAL: column})


def _same_media(a: MultiModalInputs, b: MultiModalInputs) -> bool:
    return (
        a.kinds == b.kinds
        and a.digests == b.digests
        and a.token_counts == b.token_counts
        and a.sources == b.sources
        and a.tensors.keys() == b.tensors.keys()
        and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    )


def _check_media_rows(got: Batch, media: list[MultiModalInputs], n: int) -> None:
    """Every sample reads back its prompt's media, and a prompt's samples share one object."""
    column = got[MULTI_MODAL]
    for p, m in enumerate(media):
        rows = list(column[p * n : (p + 1) * n])
        assert all(_same_media(r, m) for r in rows)
        assert all(r is rows[0] for r in rows)


def test_local_queue_stores_a_prompts_media_once_for_its_n_samples():
    """n sample copies of a prompt hold its media once: in one put or one put per sample,
    with one shared object or equal copies; the bytes go with the last row holding them."""
    n, media = 4, [_prompt_media(0), _prompt_media(1)]
    once = sum(value_nbytes(m) for m in media)
    assert once > 2 * 16 * 1176 * 4  # the pixels are counted, not a shallow object size
    q = LocalTransferQueue()
    q.put(_vl_rows(media, n, copies=False).select("input_ids"), "text")
    text = q.storage_bytes()
    q.clear("text")
    for name, copies in (("shared", False), ("copies", True)):
        rows = _vl_rows(media, n, copies)
        if copies:  # one put per sample, as streamed rollouts put them
            for i in range(len(rows)):
                q.put(rows[i : i + 1], name, sample_ids=[i])
        else:
            q.put(rows, name)
        assert q.storage_bytes() - text == once, name
        _check_media_rows(q.get_data(q.get_meta([MULTI_MODAL], None, name, "c")), media, n)
        q.clear(name)
    # Overwriting some samples keeps the media held; overwriting the last one releases it.
    q.put(_vl_rows(media, n, copies=True), "o")
    q.put(Batch({}, {MULTI_MODAL: [None] * 3}), "o", sample_ids=[0, 1, 2])
    assert q.storage_bytes() - text == once + 3 * value_nbytes(None)
    q.put(Batch({}, {MULTI_MODAL: [None] * 5}), "o", sample_ids=range(3, 8))
    assert q.storage_bytes() - text == 8 * value_nbytes(None)
    q.clear("o")
    assert q.storage_bytes() == 0


def test_local_bad_input_errors():
    q = LocalTransferQueue()
    q.put(_batch(4, group_size=2), "p")
    with pytest.raises(ValueError, match="batch_size=3 is not a multiple of group_size=2"):
        q.get_meta(["input_ids"], 3, "p", "c", sampler="group", group_size=2)
    with pytest.raises(ValueError, match="unknown sampler 'nope'"):
        q.get_meta(["input_ids"], 2, "p", "c", sampler="nope")
    with pytest.raises(TypeError, match="fields must be a sequence"):
        q.get_meta("input_ids", 2, "p", "c")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        q.get_meta(["input_ids"], 0, "p", "c")
    with pytest.raises(ValueError, match="got 3 sample_ids for a batch of 4 rows"):
        q.put(_batch(4), "p", sample_ids=[0, 1, 2])
    with pytest.raises(TypeError, match="expected a polyrl Batch"):
        q.put({"x": torch.zeros(2)}, "p")
    with pytest.raises(TypeError, match="partition must be a non-empty str"):
        q.put(_batch(1), "")
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(q)
    with pytest.raises(ValueError, match="unknown transfer queue backend 'x'"):
        make_transfer_queue("x")
    # The failed calls consumed nothing.
    assert q.status("p")["partitions"]["p"]["consumers"] == {}


def test_local_queue_served_to_other_processes_keeps_its_semantics():
    """A client from for_processes pickles; through the queue's socket it does what the queue does.

    What the rank processes of a local worker group get with ``transfer.enable=true``: a child
    process puts through one; the calls of this process go through the socket too.
    """
    import subprocess
    import sys
    from pathlib import Path

    q = LocalTransferQueue()
    child = (
        "import pickle, sys, torch\n"
        "from polyrl.core.batch import Batch\n"
        "client = pickle.loads(sys.stdin.buffer.read())\n"
        "client.put(Batch({'x': torch.arange(3.0)}), 'child')\n"
    )
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    client = pickle.loads(pickle.dumps(q.for_processes()))
    try:
        ran = subprocess.run(
            [sys.executable, "-c", child],
            input=pickle.dumps(q.for_processes()),
            env=env,
            capture_output=True,
            timeout=120,
        )
        assert ran.returncode == 0, ran.stderr.decode()
        got = q.get_data(q.get_meta(["x"], 3, "child", "driver", timeout=5))
        assert got["x"].tolist() == [0.0, 1.0, 2.0]
        b = _batch(6, seed=1)
        meta = client.put(b, "p")
        assert client.get_data(meta).equals(b)  # tensors and object columns, by value
        assert q.get_data(q.get_meta(list(b.keys()), 6, "p", "driver")).equals(b)
        # A consumer blocked in the queue's process is woken by a put from this side.
        got: list[BatchMeta] = []
        waiter = threading.Thread(
            target=lambda: got.append(client.get_meta(["x"], 2, "later", "c", timeout=20))
        )
        waiter.start()
        wait_until(lambda: len(q._cond._waiters) == 1, "the served consumer waits")
        q.put(Batch({"x": torch.zeros(2)}), "later")
        waiter.join(5)
        assert got and got[0].sample_ids == (0, 1)
        # The queue's errors reach the caller as they are.
        with pytest.raises(TransferError, match="6 samples ready for this consumer, 7 needed"):
            client.get_meta(["input_ids"], 7, "p", "c", timeout=0.05)
        assert client.status("p")["storage_bytes"] == client.storage_bytes() == q.storage_bytes()
        client.clear("p")
        assert "p" not in q.status()["partitions"]
    finally:
        client.close()
        q.close()
    with pytest.raises(TransferError, match="cannot reach the local transfer queue"):
        pickle.loads(pickle.dumps(client)).put(_batch(1), "p")


# ----------------------------------------------------------------------------------------------
# Local backend: get_meta semantics
# ----------------------------------------------------------------------------------------------
def test_get_meta_needs_all_fields_and_isolates_consumers():
    q = LocalTransferQueue()
    q.put(Batch({"a": torch.zeros(4)}), "p")
    assert len(q.get_meta(["a", "b"], None, "p", "c1")) == 0
    assert len(q.get_meta(["a", "b"], 1, "p", "c1", block=False)) == 0
    q.put(Batch({"b": torch.ones(2)}), "p", sample_ids=[3, 1])
    assert q.get_meta(["a", "b"], None, "p", "c1").sample_ids == (1, 3)
    assert len(q.get_meta(["a", "b"], None, "p", "c1")) == 0  # never twice to one consumer
    assert q.get_meta(["a"], 3, "p", "c2").sample_ids == (0, 1, 2)
    assert q.get_meta(["a"], None, "p", "c2").sample_ids == (3,)
    assert q.get_meta(["a"], 4, "p", "c3").sample_ids == (0, 1, 2, 3)
    st = q.status("p")["partitions"]["p"]
    assert st == {
        "samples": 4,
        "fields": {"a": 4, "b": 2},
        "consumers": {"c1": 2, "c2": 4, "c3": 4},
    }
    # Unknown partition without blocking: empty.
    assert len(q.get_meta(["a"], 2, "nope", "c", block=False)) == 0


def test_get_meta_blocks_until_a_producer_puts_and_times_out_with_a_clear_error():
    q = LocalTransferQueue()
    got: list[BatchMeta] = []

    def consume():
        got.append(q.get_meta(["x"], 3, "later", "c", timeout=20))

    def consumer_waits() -> bool:
        # The consumer is blocked on the queue's condition (CPython lists its waiters).
        return len(q._cond._waiters) == 1

    t = threading.Thread(target=consume)
    t.start()
    wait_until(consumer_waits, "the consumer waits for the partition")
    q.put(Batch({"x": torch.zeros(2)}), "later")  # partition created after the wait began
    # Woken by the put, it found 2 of its 3 samples and waits again: it did not return.
    wait_until(consumer_waits, "the consumer waits again after 2 of 3 samples")
    assert not got
    q.put(Batch({"x": torch.zeros(2)}), "later")
    t.join(5)
    assert got and got[0].sample_ids == (0, 1, 2)
    t0 = time.monotonic()
    with pytest.raises(TransferError) as err:
        q.get_meta(["x"], 5, "later", "c", timeout=0.3)
    assert time.monotonic() - t0 >= 0.3
    msg = str(err.value)
    assert "'later'" in msg and "'c'" in msg and "['x']" in msg
    assert "1 samples ready" in msg and "5 needed" in msg
    with pytest.raises(TransferError, match="does not exist yet"):
        q.get_meta(["x"], 1, "never", "c", timeout=0.05)


def test_local_concurrent_threads_lose_and_duplicate_nothing():
    q = LocalTransferQueue()
    n_prod, per_prod, chunk = 3, 128, 8  # 48 groups of 8: a whole number of batches
    seen: dict[str, list[int]] = {"c0": [], "c1": []}
    errors: list[BaseException] = []

    def produce(k):
        rng = np.random.default_rng(k)
        for s in range(0, per_prod, chunk):
            b = Batch({"v": torch.full((chunk,), float(k))}, {"uid": [f"{k}-{s}"] * chunk})
            q.put(b, "p")
            time.sleep(float(rng.uniform(0, 0.003)))

    def consume(name):
        try:
            total = 0
            while total < n_prod * per_prod:
                m = q.get_meta(["v"], 16, "p", name, sampler="group", group_size=8, timeout=20)
                assert len(set(m.groups)) == 2
                seen[name].extend(m.sample_ids)
                total += len(m)
        except BaseException as exc:  # re-raised in the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(n_prod)]
    threads += [threading.Thread(target=consume, args=(c,)) for c in seen]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for ids in seen.values():
        assert sorted(ids) == list(range(n_prod * per_prod))


def test_async_variants_do_not_block_the_event_loop():
    import asyncio

    q = LocalTransferQueue()

    async def main():
        waiter = asyncio.create_task(q.async_get_meta(["x"], 2, "p", "c", timeout=10))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await q.async_put(Batch({"x": torch.arange(2)}), "p")
        meta = await waiter
        data = await q.async_get_data(meta)
        st = await q.async_status("p")
        await q.async_clear("p")
        return data, st

    data, st = asyncio.run(main())
    assert data["x"].tolist() == [0, 1] and st["partitions"]["p"]["samples"] == 2
    assert q.storage_bytes() == 0


def test_sync_calls_work_in_a_thread_that_runs_an_event_loop():
    import asyncio

    q = LocalTransferQueue()

    async def main():  # a sync call blocks this loop's thread, as any blocking call does
        q.put(Batch({"x": torch.arange(3)}), "p")
        data = q.get_data(q.get_meta(["x"], 3, "p", "c", timeout=10))
        st = q.status("p")
        q.clear("p")
        return data, st

    data, st = asyncio.run(main())
    assert data["x"].tolist() == [0, 1, 2] and st["partitions"]["p"]["samples"] == 3
    q.close()


def test_sync_and_async_variants_keep_the_signatures_of_the_api():
    import inspect

    from polyrl.transfer import RayTransferQueue, TransferQueue

    for cls in (TransferQueue, LocalTransferQueue, RayTransferQueue):
        for name in ("put", "get_meta", "get_data", "clear", "status"):
            sync, coro = getattr(cls, name), getattr(cls, f"async_{name}")
            assert sync.__name__ == name and sync.__qualname__ == f"TransferQueue.{name}"
            assert inspect.signature(sync) == inspect.signature(coro)
            assert inspect.iscoroutinefunction(coro) and not inspect.iscoroutinefunction(sync)
    params = inspect.signature(LocalTransferQueue.get_meta).parameters
    assert list(params) == [
        "self",
        "fields",
        "batch_size",
        "partition",
        "consumer",
        "sampler",
        "block",
        "timeout",
        "sampler_kwargs",
    ]
    assert params["sampler"].default == "sequential" and params["timeout"].default is None


def test_client_loops_run_coroutines_for_blocked_callers_of_any_thread():
    import asyncio

    from polyrl.transfer._twins import ClientLoops, waits_in_place

    loops = ClientLoops()

    async def at_once():
        return waits_in_place()

    async def awaits():
        await asyncio.sleep(0.01)
        both = await asyncio.gather(asyncio.sleep(0, "a"), asyncio.sleep(0.01, "b"))
        return both, waits_in_place(), asyncio.current_task() is not None

    async def fails():
        await asyncio.sleep(0)
        raise TransferError("from the coroutine")

    assert loops.run(at_once()) is True  # waits in place: nothing else runs on that loop
    assert loops.run(awaits()) == (["a", "b"], True, True)
    with pytest.raises(TransferError, match="from the coroutine"):
        loops.run(fails())
    assert asyncio.run(at_once()) is False  # awaited elsewhere, it must not block

    async def inside_a_loop():  # this thread's loop cannot run another: a helper thread does
        return loops.run(awaits()), threading.current_thread().name

    (result, name) = asyncio.run(inside_a_loop())
    assert result == (["a", "b"], True, True) and name == threading.current_thread().name
    out: list[object] = []
    threads = [threading.Thread(target=lambda: out.append(loops.run(awaits()))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out == [(["a", "b"], True, True)] * 4
    loops.close()
    assert loops.run(at_once()) is True  # a closed ClientLoops opens a new loop when called
    loops.close()


# ----------------------------------------------------------------------------------------------
# Samplers
# ----------------------------------------------------------------------------------------------
def _infos(groups, lengths=None):
    lengths = lengths or [0] * len(groups)
    return [SampleInfo(i, g, n) for i, (g, n) in enumerate(zip(groups, lengths, strict=True))]


def test_sequential_sampler():
    s = get_sampler("sequential")
    ready = _infos([None] * 5)
    assert s.select(ready, 3) == [0, 1, 2]
    assert s.select(ready, 6) is None
    assert s.select(ready, None) == [0, 1, 2, 3, 4]


def test_group_sampler_takes_whole_groups_in_order_of_lowest_id():
    s = get_sampler("group", group_size=2)
    # Group "b" is complete (ids 1, 4), "a" only has 0, "c" has 2, 3.
    ready = _infos(["a", "b", "c", "c", "b"])
    assert s.select(ready, 4) == [1, 4, 2, 3]
    assert s.select(ready, 2) == [1, 4]
    assert s.select(ready, 6) is None
    assert s.select(ready, None) == [1, 4, 2, 3]
    with pytest.raises(ValueError, match="more than group_size=2"):
        s.select(_infos(["a", "a", "a"]), 2)
    with pytest.raises(ValueError, match="needs a group id"):
        s.select(_infos([None, None]), 2)
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        get_sampler("group", group_size=0)


def test_local_group_sampler_never_splits_a_group_across_calls():
    q = LocalTransferQueue()
    # Members of group g{k} arrive in different puts (sample ids given by the producer).
    order = np.random.default_rng(0).permutation(24)
    for pos in range(0, 24, 5):
        ids = order[pos : pos + 5].tolist()
        q.put(Batch({"v": torch.tensor(ids)}, {"uid": [f"g{i // 4}" for i in ids]}), "p", ids)
        m = q.get_meta(["v"], None, "p", "c", sampler="group", group_size=4)
        for k in range(0, len(m), 4):
            assert len(set(m.groups[k : k + 4])) == 1
        groups = [m.groups[k] for k in range(0, len(m), 4)]
        assert len(set(groups)) == len(groups)
    assert q.status("p")["partitions"]["p"]["consumers"]["c"] == 24


def test_length_balanced_sampler_balances_tokens_across_ranks():
    # A clearly unbalanced sequential split gets balanced.
    lengths = [50, 40, 1, 1, 1, 1]
    ids = get_sampler("length_balanced", dp_size=2).select(_infos([None] * 6, lengths), 6)
    meta = BatchMeta("p", ids, (), [0] * 6, [None] * 6, [lengths[i] for i in ids])
    assert [sum(m.lengths) for m in meta.chunk(2)] == [52, 42]  # sequential: 91 / 3
    halves = [sum(lengths[i] for i in ids[:3]), sum(lengths[i] for i in ids[3:])]
    assert sorted(halves) == [42, 52]
    # Hand-computed greedy longest-first: 50 -> r0, 40 -> r1, the next two 1s to the lighter
    # r1 (now full), the last two to r0; each rank's rows in id order.
    assert ids == [0, 4, 5, 1, 2, 3]
    # With groups and batch_size None: whole groups, count a multiple of dp_size.
    s = get_sampler("length_balanced", dp_size=4, group_size=2)
    ready = _infos(["a", "a", "b", "b", "c", "c"], [5, 6, 7, 8, 9, 10])
    ids = s.select(ready, None)
    assert sorted(ids) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="not a multiple of dp_size=4"):
        s.select(ready, 6)


# ----------------------------------------------------------------------------------------------
# Ray backend
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_queue(ray_session):
    q = make_transfer_queue("ray", num_storage_units=2, block_size=64)
    yield q
    q.close()


def _group_batch(gids: list[int], group_size: int) -> Batch:
    """Rows whose content is a function of (group id, member), so consumers can verify it."""
    rows = [(g, k) for g in gids for k in range(group_size)]
    key = torch.tensor([g * 16 + k for g, k in rows], dtype=torch.int64)
    seq = 12
    lengths = [(g + k) % seq + 1 for g, k in rows]
    return Batch(
        {
            "input_ids": key[:, None] * 1000 + torch.arange(seq),
            "attention_mask": (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long(),
            "score": key.to(torch.float32) / 7,
            "half": (key.to(torch.float32) / 3).to(torch.bfloat16)[:, None].repeat(1, 2),
        },
        {
            "uid": [f"g{g}" for g, _ in rows],
            "response_ids": [torch.arange(n) + key[i] for i, n in enumerate(lengths)],
            "text": [f"sample {g}/{k}" for g, k in rows],
        },
    )


def _check_group_rows(batch: Batch) -> int:
    """Number of rows whose data is not what _group_batch put for their uid/member."""
    bad = 0
    for i in range(len(batch)):
        g = int(batch["uid"][i][1:])
        key = int(batch["input_ids"][i, 0]) // 1000
        k = key - g * 16
        ref = _group_batch([g], 4)[k : k + 1].select(*batch.keys())
        row = batch[i : i + 1]
        if not (0 <= k < 4 and row.equals(ref)):
            bad += 1
    return bad


def test_ray_round_trip_clear_and_errors(ray_queue):
    q = ray_queue
    b = _batch(300, seed=3)
    m = q.put(b, "rt")
    assert m.sample_ids == tuple(range(300))
    assert set(m.units) == {0, 1}  # blocks of 64 ids rotate over the two local units
    got = q.get_data(m)
    assert got.equals(b)
    rev = q.get_data(m[list(range(299, -1, -3))], fields=["hidden", "prompt"])
    assert torch.equal(rev["hidden"], b["hidden"][list(range(299, -1, -3))])
    assert list(rev["prompt"]) == [f"prompt {i}" for i in range(299, -1, -3)]
    # Adding a field to existing samples lands on their unit.
    extra = q.put(Batch({"adv": torch.arange(3.0)}), "rt", sample_ids=[250, 5, 70])
    assert extra.units == (m.units[250], m.units[5], m.units[70])
    meta = q.get_meta(["adv", "input_ids"], None, "rt", "c")
    assert meta.sample_ids == (5, 70, 250)
    assert q.get_data(meta, ["adv"])["adv"].tolist() == [1.0, 2.0, 0.0]
    with pytest.raises(TransferError, match=r"field 'adv' .* missing for sample ids \[0\]"):
        q.get_data(m[:1], ["adv"])
    with pytest.raises(TransferError, match="timed out .* 'rt', consumer 'c'"):
        q.get_meta(["adv"], 3, "rt", "c", timeout=0.2)
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        q.get_meta(["input_ids"], 6, "rt", "c", sampler="group", group_size=4)
    st = q.status("rt")
    assert st["partitions"]["rt"]["fields"]["adv"] == 3
    assert st["partitions"]["rt"]["consumers"] == {"c": 3}
    # Clear frees storage (measured on the units).
    before = q.storage_bytes()
    tensor_bytes = sum(t.numel() * t.element_size() for t in b.tensors.values())
    assert before >= tensor_bytes
    q.clear("rt")
    assert q.storage_bytes() == 0
    with pytest.raises(TransferError, match="unknown partition 'rt'"):
        q.get_data(m)


def test_ray_units_store_a_prompts_media_once_and_readers_get_it_once(ray_queue):
    """Rows put per sample with equal copies: each unit holds a prompt's media once, and a
    reader gets one object per prompt (its pickled reply carries the pixels once)."""
    n, media = 4, [_prompt_media(2), _prompt_media(3)]
    q = ray_queue
    rows = _vl_rows(media, n, copies=True)
    for i in range(len(rows)):
        q.put(rows[i : i + 1], "vl", sample_ids=[i])
    meta = q.get_meta([MULTI_MODAL, "input_ids"], None, "vl", "c")
    # block_size 64: samples 0..7 live on one unit.
    assert len(set(meta.units)) == 1
    text = sum(value_nbytes(v) for v in (rows["input_ids"][i].numpy() for i in range(8)))
    assert q.storage_bytes() == text + sum(value_nbytes(m) for m in media)
    got = q.get_data(meta)
    _check_media_rows(got, media, n)
    assert torch.equal(got["input_ids"], rows["input_ids"])
    q.clear("vl")
    assert q.storage_bytes() == 0


def test_two_ray_queues_coexist_and_async_client(ray_queue):
    import asyncio

    q1 = ray_queue
    q2 = make_transfer_queue("ray", num_storage_units=1)
    try:
        assert q1.name != q2.name
        q1.put(Batch({"x": torch.arange(4)}), "p")

        async def main():
            waiter = asyncio.create_task(q2.async_get_meta(["x"], 2, "p", "c", timeout=30))
            await asyncio.sleep(0.2)
            assert not waiter.done()  # q2 has no data: q1's put did not reach it
            await q2.async_put(Batch({"x": torch.arange(10, 12)}), "p")
            meta = await waiter
            data = await q2.async_get_data(meta)
            st = await q2.async_status()
            await q2.async_clear("p")
            return data, st

        data, st = asyncio.run(main())
        assert data["x"].tolist() == [10, 11] and st["partitions"]["p"]["samples"] == 2
        assert q2.storage_bytes() == 0 and q1.storage_bytes() > 0
        from polyrl.transfer import RayTransferQueue

        again = RayTransferQueue.connect(q1.name)
        assert again.get_data(again.get_meta(["x"], 4, "p", "c"))["x"].tolist() == [0, 1, 2, 3]
        again.close()  # a connected client does not own the actors: nothing is killed
        q1.clear("p")
        assert q1.storage_bytes() == 0
    finally:
        q2.close()


def test_ray_sync_calls_from_an_async_actor_and_a_running_loop(ray_session, ray_queue):
    import asyncio

    ray = ray_session

    @ray.remote(num_cpus=0)
    class AsyncUser:  # an asyncio actor: its methods run on the actor's event loop
        async def round_trip(self, queue, partition):
            queue.put(Batch({"x": torch.arange(4)}), partition)
            first = queue.get_data(queue.get_meta(["x"], 2, partition, "c", timeout=30))
            meta = await queue.async_get_meta(["x"], 2, partition, "c", timeout=30)
            rest = await queue.async_get_data(meta)
            return first["x"].tolist() + rest["x"].tolist()

    user = AsyncUser.remote()
    assert ray.get(user.round_trip.remote(ray_queue, "actor-loop")) == [0, 1, 2, 3]
    ray_queue.clear("actor-loop")

    async def main():  # the driver's own loop: sync calls block it and work
        ray_queue.put(Batch({"x": torch.arange(5)}), "driver-loop")
        return ray_queue.get_data(ray_queue.get_meta(["x"], 5, "driver-loop", "c", timeout=30))

    assert asyncio.run(main())["x"].tolist() == [0, 1, 2, 3, 4]
    ray_queue.clear("driver-loop")
    ray.kill(user)


# The acceptance test's sizes: 10,000 samples in groups of 4, 3 producers and 3 consumers.
_GROUP_SIZE, _N_GROUPS, _N_PRODUCERS, _N_CONSUMERS = 4, 2500, 3, 3


class _AcceptanceProducer:
    """Puts the rows of its share of the groups, a random number of groups at a time."""

    def run(self, queue, gids, seed):
        rng = np.random.default_rng(seed)
        pos = 0
        while pos < len(gids):
            k = int(rng.integers(1, 40))
            queue.put(_group_batch(gids[pos : pos + k], _GROUP_SIZE), "acc")
            pos = min(pos + k, len(gids))
            time.sleep(float(rng.uniform(0, 0.01)))
        return pos


class _AcceptanceConsumer:
    """Reads every sample once with the group sampler, in batches of random sizes, checking
    that groups arrive whole and (for a fifth of the batches) that every row is what was put."""

    def run(self, queue, name, seed):
        total = _GROUP_SIZE * _N_GROUPS
        rng = np.random.default_rng(seed)
        ids, split, bad, got = [], 0, 0, 0
        while got < total:
            bs = min(int(rng.choice([8, 16, 64, 256])), total - got)
            meta = queue.get_meta(
                ["input_ids", "uid", "response_ids"],
                bs,
                "acc",
                name,
                sampler="group",
                group_size=_GROUP_SIZE,
                timeout=120,
            )
            data = queue.get_data(meta, list(_group_batch([0], 1).keys()))
            counts: dict[str, int] = {}
            for g in meta.groups:
                counts[g] = counts.get(g, 0) + 1
            split += sum(c != _GROUP_SIZE for c in counts.values())
            bad += _check_group_rows(data) if rng.random() < 0.2 else 0
            bad += sum(data["uid"][i] != g for i, g in enumerate(meta.groups))
            ids.extend(meta.sample_ids)
            got += len(meta)
            time.sleep(float(rng.uniform(0, 0.01)))
        return ids, split, bad


@pytest.fixture(scope="module")
def acceptance_actors(ray_session):
    """The acceptance test's producer and consumer actors, started once for both of its runs.

    Each actor's start imports torch and polyrl in a new Ray worker: most of a run's time. The
    queue each run uses is an argument of ``run``, so both runs drive the same actors.
    """
    import sys

    from ray import cloudpickle

    ray = ray_session
    # The actors are classes of this module, which Ray workers cannot import by name.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        producer, consumer = (
            ray.remote(num_cpus=0)(cls) for cls in (_AcceptanceProducer, _AcceptanceConsumer)
        )
        producers = [producer.remote() for _ in range(_N_PRODUCERS)]
        consumers = [consumer.remote() for _ in range(_N_CONSUMERS)]
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    yield producers, consumers
    for actor in producers + consumers:
        ray.kill(actor)


@pytest.mark.slow
@pytest.mark.parametrize("segments", [False, True], ids=["inline", "segments"])
def test_ray_acceptance_concurrent_producers_and_consumers(
    ray_session, ray_queue, acceptance_actors, segments
):
    """10,000 samples, 3 producer and 3 consumer actors with random timing, group sampler.

    ``segments``: every put, however small, travels in a shared-memory segment and is committed
    through the controller's socket (``direct_bytes=0``), so segment reuse and the socket are
    exercised under the same concurrency.
    """
    from polyrl.transfer import RayTransferQueue

    ray, q = ray_session, ray_queue
    producer_queue = RayTransferQueue.connect(q.name, direct_bytes=0) if segments else q
    producers, consumers = acceptance_actors
    total = _GROUP_SIZE * _N_GROUPS
    gids = list(range(_N_GROUPS))
    t0 = time.monotonic()
    crefs = [c.run.remote(q, f"cons{i}", 100 + i) for i, c in enumerate(consumers)]
    prefs = [
        p.run.remote(producer_queue, gids[i::_N_PRODUCERS], i) for i, p in enumerate(producers)
    ]
    assert sum(ray.get(prefs, timeout=300)) == _N_GROUPS
    results = ray.get(crefs, timeout=300)
    elapsed = time.monotonic() - t0
    for ids, split, bad in results:
        assert split == 0 and bad == 0
        assert len(ids) == total and sorted(ids) == list(range(total))  # none lost or doubled
    st = q.status("acc")["partitions"]["acc"]
    assert st["samples"] == total and st["consumers"] == {
        f"cons{i}": total for i in range(_N_CONSUMERS)
    }
    # Every sample's data, fetched by the driver, equals what was put.
    meta = q.get_meta(["input_ids"], None, "acc", "driver")
    data = q.get_data(meta, ["uid", "input_ids", "attention_mask", "score", "half", "text"])
    assert _check_group_rows(data[::97]) == 0
    before = q.storage_bytes()
    q.clear("acc")
    after = q.storage_bytes()
    assert before > total * 12 * 8 * 2 and after == 0, (before, after)
    print(f"acceptance: {total} samples in {elapsed:.1f} s")


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "object-store"])
def test_ray_large_blocks_are_read_from_the_producers_copy(ray_session, ray_queue, use_shm):
    """Blocks over direct_bytes are copied once (a segment or ray.put); whole runs map it."""
    ray = ray_session
    from polyrl.transfer import RayTransferQueue

    q = RayTransferQueue.connect(ray_queue.name, direct_bytes=0, block_size=64, use_shm=use_shm)
    try:
        b = _batch(100, seed=5)
        m = q.put(b, "direct")
        node = ray.get_runtime_context().get_node_id()
        first_block = [i for i in range(100) if m.units[i] == m.units[0]][:10]
        kind = ray.get(q.units[m.units[0]].get.remote("direct", first_block, ["input_ids"], node))
        assert kind[0] == ("shm" if use_shm else "ref")
        assert q.get_data(m).equals(b)  # mixes blocks of both units
        assert q.get_data(m[[5, 3, 1]]).equals(b[[5, 3, 1]])  # out of order: gathered copy
        # A field overwritten for some samples no longer comes from the original object.
        q.put(Batch({"log_probs": torch.zeros(2, 6)}), "direct", sample_ids=[1, 2])
        want = b.clone()
        want["log_probs"][1:3] = 0
        assert q.get_data(m[:10]).equals(want[:10])
    finally:
        q.clear("direct")


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "object-store"])
def test_ray_get_meta_of_one_block_reads_the_producers_copy_directly(
    ray_session, ray_queue, use_shm
):
    """The controller hands out the source of a whole in-order block; rewrites invalidate it.

    A segment's descriptor comes back through the controller's socket; an ObjectRef cannot
    cross it, so the object-store variant asks through Ray (``fast_path=None``).
    """
    from polyrl.transfer import RayTransferQueue
    from polyrl.transfer.segments import ShmBlock

    q = RayTransferQueue.connect(
        ray_queue.name,
        direct_bytes=0,
        block_size=64,
        use_shm=use_shm,
        **({} if use_shm else {"fast_path": None}),
    )
    try:
        b = _batch(40, seed=6)
        q.put(b, "hint")
        meta = q.get_meta(["input_ids", "log_probs"], 40, "hint", consumer="a")
        assert (meta.partition, 0, 40) in q._hints
        assert isinstance(q._hints[(meta.partition, 0, 40)][0], ShmBlock) == use_shm
        assert q.get_data(meta).equals(b.select("input_ids", "log_probs"))
        assert not q._hints  # used once
        # After a rewrite of some samples' log_probs the shortcut is withdrawn: fresh values.
        q.put(Batch({"log_probs": torch.ones(3, 6)}), "hint", sample_ids=[4, 5, 6])
        meta = q.get_meta(["log_probs"], 40, "hint", consumer="b")
        assert not q._hints
        want = b["log_probs"].clone()
        want[4:7] = 1
        assert torch.equal(q.get_data(meta)["log_probs"], want)
        # The whole block lost its shortcut (conservative); other fields still read right.
        meta = q.get_meta(["input_ids"], 40, "hint", consumer="c")
        assert not q._hints
        assert torch.equal(q.get_data(meta)["input_ids"], b["input_ids"])
    finally:
        q.clear("hint")


def test_ray_reader_ahead_of_the_storage_unit_waits_for_the_committed_block(ray_session, ray_queue):
    """A sealed block is committed before its unit maps it: an early reader waits, no error."""
    ray = ray_session
    from polyrl.transfer import RayTransferQueue
    from polyrl.transfer._core import batch_to_columns

    q = RayTransferQueue.connect(ray_queue.name, direct_bytes=0, adopt_timeout=1.0)
    b = _batch(16, seed=8)
    source = [ray.put(batch_to_columns(b))]
    # What put does for one sealed block, with the unit's adopt held back.
    committed = q.controller.commit_new.remote("early", list(b.keys()), [1] * 16, None, None)
    meta = ray.get(committed)
    reader = RayTransferQueue.connect(ray_queue.name)  # no source hint: asks unit 1
    out: dict[str, object] = {}
    thread = threading.Thread(target=lambda: out.update(got=reader.get_data(meta)))
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()  # waiting for the block, not failed
    ray.get(q.units[1].adopt.remote("early", committed, source))
    thread.join(30)
    assert out["got"].equals(b)
    # Committed but never adopted (its producer died mid-put): a clear error after the wait.
    lost = ray.get(q.controller.commit_new.remote("early", ["input_ids"], [0] * 4, None, None))
    with pytest.raises(TransferError, match="committed to storage unit 0 but did not reach it"):
        q.get_data(lost)
    # Never committed at all: the unit's own error, at once.
    with pytest.raises(TransferError, match="'early' holds no data in this storage unit"):
        q.get_data(lost, ["log_probs"])
    q.clear("early")


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "object-store"])
def test_ray_reads_survive_the_death_of_the_producer(ray_session, ray_queue, use_shm):
    import os

    ray = ray_session

    @ray.remote(num_cpus=0)
    class OneShot:
        def put(self, queue, batch):
            return queue.put(batch, "orphan")

        def pid(self):
            return os.getpid()

    from polyrl.core.shm import shm_root, sweep_dead
    from polyrl.transfer import RayTransferQueue
    from polyrl.transfer.segments import SEGMENT_DIR_ENV, SEGMENT_PREFIX

    q = RayTransferQueue.connect(ray_queue.name, direct_bytes=0, use_shm=use_shm)
    b = Batch({"x": torch.arange(64 * 1024).reshape(64, 1024)}, {"s": [str(i) for i in range(64)]})
    producer = OneShot.remote()
    try:
        meta = ray.get(producer.put.remote(q, b))
        root = shm_root(SEGMENT_DIR_ENV)
        theirs = f"{SEGMENT_PREFIX}{ray.get(producer.pid.remote())}-*"
        files = sorted(root.glob(theirs)) if use_shm and root is not None else []
        ray.kill(producer)
        time.sleep(1.0)
        # The producer owned the object (or the segment file) the unit keeps; the unit still
        # maps it, and get_data falls back to the unit's gathered copy once the reference is
        # lost or the dead producer's segment files were swept.
        got = q.get_data(q.get_meta(["x", "s"], 64, "orphan", "c", timeout=10))
        assert meta.sample_ids == tuple(range(64)) and got.equals(b)
        if use_shm:
            assert files, f"the producer wrote no segment {theirs} under {root}"

            # Swept here once the killed process is gone, or already by whoever swept first
            # (another test process, a new pool): the dead producer's files go either way.
            def swept() -> bool:
                sweep_dead(root, SEGMENT_PREFIX)
                return not any(f.exists() for f in files)

            wait_until(swept, "the killed producer's segment files swept", timeout=30.0)
            again = q.get_data(q.get_meta(["x", "s"], 64, "orphan", "c2", timeout=10))
            assert again.equals(b)  # read from the unit's mapping, not the (gone) file
    finally:
        ray.kill(producer)
        q.clear("orphan")


def test_batch_meta_pickles_compactly_and_exactly():
    import pickle
    import random

    rng = random.Random(0)
    uids = [f"{rng.getrandbits(128):032x}" for _ in range(125)]
    meta = BatchMeta(
        "step-7",
        tuple(range(1000, 2000)),
        ("prompt_ids", "response_ids"),
        (0,) * 500 + (1,) * 500,
        tuple(uids[i // 8] for i in range(1000)),
        tuple(rng.randrange(1, 3000) for _ in range(1000)),
    )
    data = pickle.dumps(meta)
    # The 125 group ids (32 chars each), then per sample: 1 byte of unit, 1 byte of group
    # index and 2 bytes of length; the id run is two numbers.
    assert len(data) < 125 * 45 + 1000 * 4 + 500, len(data)
    for piece in (meta, meta[[7, 3, 999]], meta.chunk(3)[1], BatchMeta.empty("p", ("a",))):
        assert pickle.loads(pickle.dumps(piece)) == piece
    big = BatchMeta("p", (2**40, 5), (), (0, 0), (None, "g"), (0, 2**33))
    assert pickle.loads(pickle.dumps(big)) == big
