"""A ~50 MB Batch crosses Ray's object store between two actors without being copied on get.

The zero-copy check is structural, not a timing: in the receiving actor we look up which memory
mapping of the process holds each tensor's data pointer (``/proc/self/maps``).  Zero-copy means
the bytes live in Ray's shared-memory object store (a shared ``plasma*`` file mapping); a copy
would live in private anonymous/heap memory.  A torch-pickled dict of tensors, sent the same way,
is the negative control proving the check can fail.
"""

from __future__ import annotations

import hashlib
import sys
import warnings

import pytest
import torch

from polyrl.core.batch import Batch

ROWS, WIDTH = 1024, 12 * 1024  # float32 column: 48 MiB; whole Batch ~ 50 MB


def _mapping_of(ptr: int) -> tuple[str, str]:
    """(permissions, path) of the mapping of this process that contains address ``ptr``."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[1], fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"address {ptr:#x} is in no mapping of this process")


def _in_object_store(t: torch.Tensor) -> bool:
    perms, path = _mapping_of(t.data_ptr())
    return perms[3] == "s" and "plasma" in path


def _make_batch() -> Batch:
    gen = torch.Generator().manual_seed(0)
    return Batch(
        {
            "hidden": torch.randn(ROWS, WIDTH, generator=gen),
            "logp": torch.randn(ROWS, 256, generator=gen).bfloat16(),
            "ids": torch.randint(0, 50_000, (ROWS, 128), generator=gen),
            "mask": torch.rand(ROWS, 128, generator=gen) > 0.5,
            "adv": torch.randn(ROWS, generator=gen).half(),
        },
        {"prompt": [f"prompt {i}" for i in range(ROWS)], "gt": [{"a": i} for i in range(ROWS)]},
        meta={"weight_version": 7},
    )


def _fingerprint(b: Batch) -> dict[str, str]:
    """Exact per-column digest of the raw bytes (float sums vary with thread count)."""
    return {
        k: hashlib.sha256(b[k].contiguous().view(torch.uint8).numpy().data).hexdigest()
        for k in b.tensor_keys
    }


def _producer_cls(ray):
    @ray.remote(num_cpus=0)
    class Producer:
        def make(self) -> Batch:
            return _make_batch()

        def make_torch_pickled(self) -> dict[str, torch.Tensor]:
            return {"hidden": torch.randn(ROWS, WIDTH)}

    return Producer


def _consumer_cls(ray):
    @ray.remote(num_cpus=0)
    class Consumer:
        def inspect(self, wrapped: list) -> dict:
            ref = wrapped[0]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                b = ray.get(ref)
            again = ray.get(ref)
            out = {
                "len": len(b),
                "warnings": [str(w.message) for w in caught],
                "dtypes": {k: str(b[k].dtype) for k in b.tensor_keys},
                "in_store": {k: _in_object_store(b[k]) for k in b.tensor_keys},
                # Two gets of one object map the same shared bytes; copies would not.
                "same_ptr_twice": {
                    k: b[k].data_ptr() == again[k].data_ptr() for k in b.tensor_keys
                },
                "fingerprint": _fingerprint(b),
                "prompt_5": b["prompt"][5],
                "gt_9": b["gt"][9],
                "meta": b.meta,
            }
            cloned = b.clone()
            cloned["hidden"].add_(1.0)  # a clone is private, writable memory
            out["clone_in_store"] = _in_object_store(cloned["hidden"])
            out["store_untouched"] = bool(torch.equal(b["hidden"], again["hidden"]))
            return out

        def inspect_direct(self, b: Batch) -> bool:
            # Ray resolved the top-level ref before the call; still straight from the store.
            return all(_in_object_store(b[k]) for k in b.tensor_keys)

        def inspect_torch_pickled(self, wrapped: list) -> tuple[bool, bool]:
            d = ray.get(wrapped[0])
            again = ray.get(wrapped[0])
            return _in_object_store(d["hidden"]), d["hidden"].data_ptr() == again[
                "hidden"
            ].data_ptr()

    return Consumer


@pytest.mark.slow
def test_batch_crosses_ray_zero_copy(ray_session):
    ray = ray_session
    # Workers cannot import this test module, so ship its helpers by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    producer = _producer_cls(ray).remote()
    consumer = _consumer_cls(ray).remote()
    expected = _make_batch()
    size = sum(t.numel() * t.element_size() for t in expected.tensors.values())
    assert size > 50_000_000

    ref = producer.make.remote()
    got = ray.get(consumer.inspect.remote([ref]))

    assert got["len"] == ROWS
    assert got["warnings"] == []  # torch's read-only numpy warning is suppressed
    assert got["dtypes"] == {k: str(v.dtype) for k, v in expected.tensors.items()}
    assert got["in_store"] == dict.fromkeys(expected.tensor_keys, True)
    assert got["same_ptr_twice"] == dict.fromkeys(expected.tensor_keys, True)
    assert got["fingerprint"] == _fingerprint(expected)
    assert got["prompt_5"] == "prompt 5" and got["gt_9"] == {"a": 9}
    assert got["meta"] == {"weight_version": 7}
    assert got["clone_in_store"] is False and got["store_untouched"] is True

    assert ray.get(consumer.inspect_direct.remote(ref)) is True

    # The driver gets the same object zero-copy as well, with identical values.
    here = ray.get(ref)
    assert here.equals(expected)
    assert all(_in_object_store(here[k]) for k in here.tensor_keys)

    # Negative control: torch's own pickling copies out of the store on every get.
    in_store, same_ptr = ray.get(
        consumer.inspect_torch_pickled.remote([producer.make_torch_pickled.remote()])
    )
    assert in_store is False and same_ptr is False
