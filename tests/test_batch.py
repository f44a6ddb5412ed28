"""Unit and property tests for polyrl.core.batch.Batch (no Ray; see test_batch_ray.py for that)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from polyrl.core.batch import Batch, collate

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
]


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -1000), min(info.max, 1000), shape, generator=gen, dtype=dtype
    )


OBJECTS = st.one_of(
    st.text(max_size=5),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.lists(st.integers(), max_size=3),
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
)


@st.composite
def batches(draw, min_len: int = 0, max_len: int = 7) -> Batch:
    n = draw(st.integers(min_len, max_len))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    dtypes = draw(st.lists(st.sampled_from(DTYPES), max_size=3))
    tensors = {}
    for i, dtype in enumerate(dtypes):
        trailing = draw(st.sampled_from([(), (2,), (3, 2)]))
        tensors[f"t{i}"] = make_tensor(dtype, (n, *trailing), gen)
    n_obj = draw(st.integers(0, 2))
    objects = {f"o{i}": draw(st.lists(OBJECTS, min_size=n, max_size=n)) for i in range(n_obj)}
    meta = draw(st.dictionaries(st.sampled_from(["v", "temp", "tag"]), st.integers(), max_size=2))
    return Batch(tensors, objects, meta=meta, batch_size=n)


def sample() -> Batch:
    return Batch(
        {
            "ids": torch.arange(12).reshape(6, 2),
            "mask": torch.tensor([True, False, True, True, False, True]),
            "lp": torch.linspace(0, 1, 6, dtype=torch.bfloat16),
        },
        {"prompt": list("abcdef"), "gt": [{"answer": i} for i in range(6)]},
        meta={"weight_version": 3},
    )


# ---------------------------------------------------------------------------------- construction
def test_construct_and_basic_protocol():
    b = sample()
    assert len(b) == 6
    assert b.keys() == ["ids", "mask", "lp", "prompt", "gt"]
    assert b.tensor_keys == ["ids", "mask", "lp"] and b.non_tensor_keys == ["prompt", "gt"]
    assert "ids" in b and "gt" in b and "nope" not in b and 3 not in b
    assert isinstance(b.tensors, TensorDict) and b.tensors.batch_size == torch.Size([6])
    assert b["prompt"].dtype == object and b["prompt"].shape == (6,)
    assert b["gt"][2] == {"answer": 2}
    text = repr(b)
    assert "len=6" in text and "ids: int64[6, 2]" in text and "lp: bfloat16[6]" in text
    assert "prompt" in text and "weight_version" in text


def test_object_columns_keep_one_element_per_row():
    b = Batch(non_tensors={"lists": [[1, 2], [3, 4], [5, 6]], "arr": np.arange(6).reshape(3, 2)})
    assert b["lists"].shape == (3,) and b["lists"][1] == [3, 4]
    assert b["arr"].shape == (3,) and np.array_equal(b["arr"][2], [4, 5])
    strings = Batch(non_tensors={"s": np.array(["x", "yy"])})
    assert strings["s"].dtype == object and strings["s"][1] == "yy"


def test_accepts_tensordict_with_empty_batch_size():
    td = TensorDict({"a": torch.zeros(4, 3)}, batch_size=[])
    b = Batch(td)
    assert len(b) == 4 and b.tensors.batch_size == torch.Size([4])


def test_column_less_batch_sizes():
    assert len(Batch()) == 0
    assert len(Batch(batch_size=5)) == 5
    b = Batch()
    b["q"] = [1, 2, 3]
    assert len(b) == 3
    sized = Batch(batch_size=2)
    with pytest.raises(ValueError, match="'q' has length 3, expected the Batch length 2"):
        sized["q"] = [1, 2, 3]


def test_construction_errors():
    with pytest.raises(ValueError, match=r"length mismatch: \{'b': 2\}"):
        Batch({"a": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"'s': 2.*batch_size=3"):
        Batch({"a": torch.zeros(3)}, {"s": ["x", "y"]}, batch_size=3)
    with pytest.raises(TypeError, match=r"tensors\['a'\] must be a torch.Tensor"):
        Batch({"a": [1, 2]})
    with pytest.raises(ValueError, match="'a' is given both"):
        Batch({"a": torch.zeros(2)}, {"a": [1, 2]})
    with pytest.raises(ValueError, match="0-dim"):
        Batch({"a": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="column 's'.*str"):
        Batch(non_tensors={"s": "abc"})
    with pytest.raises(TypeError, match="nested TensorDicts"):
        Batch(TensorDict({"n": TensorDict({"x": torch.zeros(2)}, [2])}, [2]))
    with pytest.raises(ValueError, match="non-negative int"):
        Batch(batch_size=-1)
    with pytest.raises(TypeError, match="non-empty str"):
        Batch({"": torch.zeros(2)})


# ---------------------------------------------------------------------------------- indexing
def test_getitem_rows():
    b = sample()
    one = b[1]
    assert isinstance(one, Batch) and len(one) == 1
    assert one["prompt"].tolist() == ["b"] and one["ids"].tolist() == [[2, 3]]
    assert b[-1]["prompt"].tolist() == ["f"]
    assert b[1:4]["prompt"].tolist() == ["b", "c", "d"]
    assert b[::2]["ids"][:, 0].tolist() == [0, 4, 8]
    picks = [[4, 0], np.array([4, 0]), torch.tensor([4, 0]), (4, 0), [-2, 0]]
    for idx in picks:
        got = b[idx]
        assert got["prompt"].tolist() == ["e", "a"] and got["ids"][:, 0].tolist() == [8, 0]
        assert got.meta == {"weight_version": 3}
    mask = [True, False, False, False, True, False]
    for m in (mask, np.array(mask), torch.tensor(mask)):
        assert b[m]["prompt"].tolist() == ["a", "e"]
    assert len(b[[]]) == 0 and b[[]].keys() == b.keys()
    assert b[torch.tensor(2)]["prompt"].tolist() == ["c"]


def test_getitem_errors():
    b = sample()
    with pytest.raises(KeyError, match="unknown column 'nope'"):
        b["nope"]
    with pytest.raises(IndexError, match="row index 6 is out of range"):
        b[6]
    with pytest.raises(IndexError, match="row index -7"):
        b[[0, -7]]
    with pytest.raises(IndexError, match="mask has length 2, expected the Batch length 6"):
        b[[True, False]]
    with pytest.raises(TypeError, match="integers or bools"):
        b[np.array([0.5])]
    with pytest.raises(TypeError, match="bare bool"):
        b[True]
    with pytest.raises(TypeError, match="not iterable"):
        list(b)


def test_setitem_and_delitem():
    b = sample()
    b["reward"] = torch.ones(6)
    assert "reward" in b.tensor_keys
    b["reward"] = [1.0] * 6  # a non-tensor replaces the tensor column
    assert "reward" in b.non_tensor_keys and "reward" not in b.tensor_keys
    b["reward"] = torch.zeros(6)
    assert b.keys().count("reward") == 1 and "reward" in b.tensor_keys
    with pytest.raises(ValueError, match="'bad' has length 5, expected the Batch length 6"):
        b["bad"] = torch.zeros(5)
    with pytest.raises(ValueError, match="'bad' has length 2"):
        b["bad"] = ["x", "y"]
    with pytest.raises(TypeError, match="'td': nested TensorDicts"):
        b["td"] = TensorDict({"x": torch.zeros(6)}, [6])
    with pytest.raises(TypeError, match="'d'.*got dict"):
        b["d"] = {"a": 1}
    with pytest.raises(TypeError, match="got int"):
        b["n"] = 3
    del b["reward"]
    del b["gt"]
    assert "reward" not in b and "gt" not in b
    with pytest.raises(KeyError, match="unknown column 'gt'"):
        del b["gt"]


# ---------------------------------------------------------------------------------- column ops
def test_select_and_drop():
    b = sample()
    s = b.select("prompt", "ids")
    assert s.keys() == ["ids", "prompt"] and s.meta == b.meta and len(s) == 6
    assert b.select("ids", meta_keys=[]).meta == {}
    assert b.select(meta_keys=["weight_version"]).keys() == []
    assert len(b.select()) == 6
    with pytest.raises(KeyError, match=r"select: unknown column\(s\) \['x'\]"):
        b.select("ids", "x")
    with pytest.raises(KeyError, match="unknown meta key"):
        b.select("ids", meta_keys=["temperature"])
    d = b.drop("mask", "gt")
    assert d.keys() == ["ids", "lp", "prompt"]
    assert b.keys() == ["ids", "mask", "lp", "prompt", "gt"]  # original untouched
    with pytest.raises(KeyError, match=r"drop: unknown column\(s\) \['zzz'\]"):
        b.drop("zzz")


def test_union():
    b = sample()
    left = b.select("ids", "prompt")
    right = b.select("ids", "mask", "gt", meta_keys=[])
    right.meta["temperature"] = 1.0
    u = left.union(right)
    assert u.keys() == ["ids", "mask", "prompt", "gt"]
    assert u.meta == {"weight_version": 3, "temperature": 1.0}
    assert u.select("ids", "mask", "prompt", "gt", meta_keys=[]).equals(
        b.select("ids", "mask", "prompt", "gt", meta_keys=[])
    )
    changed = b.select("ids")
    changed["ids"] = changed["ids"] + 1
    with pytest.raises(ValueError, match="column 'ids' differs"):
        left.union(changed)
    other_prompt = Batch(non_tensors={"prompt": list("abcdeX")})
    with pytest.raises(ValueError, match="column 'prompt' differs"):
        left.union(other_prompt)
    with pytest.raises(ValueError, match="lengths differ"):
        left.union(b[:3])
    with pytest.raises(ValueError, match="'prompt' is a non-tensor in self but a tensor"):
        left.union(Batch({"prompt": torch.zeros(6)}))
    with pytest.raises(ValueError, match="meta key 'weight_version' conflicts"):
        left.union(Batch(batch_size=6, meta={"weight_version": 4}))


# ---------------------------------------------------------------------------------- row ops
def test_chunk():
    b = sample()
    parts = b.chunk(4)
    assert [len(p) for p in parts] == [2, 2, 1, 1]
    assert [p["prompt"].tolist() for p in parts] == [["a", "b"], ["c", "d"], ["e"], ["f"]]
    assert [len(p) for p in b.chunk(6)] == [1] * 6
    with pytest.raises(ValueError, match="length 6 into 7 non-empty parts"):
        b.chunk(7)
    empty_ok = b.chunk(8, allow_empty=True)
    assert [len(p) for p in empty_ok] == [1] * 6 + [0, 0]
    assert empty_ok[-1].keys() == b.keys()
    with pytest.raises(ValueError, match="chunk: n must be >= 1"):
        b.chunk(0)
    with pytest.raises(TypeError, match="chunk: n must be an int"):
        b.chunk(2.0)


def test_split():
    b = sample()
    assert [len(p) for p in b.split(4)] == [4, 2]
    assert [len(p) for p in b.split(6)] == [6]
    assert [len(p) for p in b.split(100)] == [6]
    assert b[:0].split(3) == []
    with pytest.raises(ValueError, match="split: size must be >= 1"):
        b.split(0)


def test_concat():
    b = sample()
    assert Batch.concat([b[:2], b[2:5], b[5:]]).equals(b)
    assert Batch.concat([b]).equals(b)
    assert Batch.concat([Batch(), b, Batch()]).equals(b)
    assert len(Batch.concat([])) == 0
    assert Batch.concat([b[:0], b[:0]]).keys() == b.keys()
    with pytest.raises(ValueError, match=r"batch 1 has different columns.*missing \['gt'\]"):
        Batch.concat([b, b.drop("gt")])
    with pytest.raises(ValueError, match=r"tensor/non-tensor mismatch \['mask'\]"):
        swapped = b.drop("mask")
        swapped["mask"] = b["mask"].tolist()
        Batch.concat([b, swapped])
    wrong_dtype = b.drop("ids")
    wrong_dtype["ids"] = b["ids"].int()
    with pytest.raises(ValueError, match="column 'ids' in batch 1 is torch.int32"):
        Batch.concat([b, wrong_dtype])
    wrong_shape = b.drop("ids")
    wrong_shape["ids"] = torch.zeros(6, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"column 'ids' in batch 1 .*\[3\]"):
        Batch.concat([b, wrong_shape])
    other_meta = b[:2]
    other_meta.meta["weight_version"] = 9
    with pytest.raises(ValueError, match="meta key 'weight_version' conflicts"):
        Batch.concat([b, other_meta])
    extra_meta = b[:2]
    extra_meta.meta["temperature"] = 0.7
    assert Batch.concat([b, extra_meta]).meta == {"weight_version": 3, "temperature": 0.7}
    with pytest.raises(TypeError, match="item 1 is a dict"):
        Batch.concat([b, {}])


def test_repeat():
    b = sample()[:3]
    assert b.repeat(2)["prompt"].tolist() == list("aabbcc")
    assert b.repeat(2, interleave=False)["prompt"].tolist() == list("abcabc")
    assert b.repeat(2)["ids"][:, 0].tolist() == [0, 0, 2, 2, 4, 4]
    with pytest.raises(ValueError, match="repeat: n must be >= 1"):
        b.repeat(0)


def test_pad_and_unpad():
    b = sample()[:2]
    padded, pad = b.pad_to_multiple(7)
    assert pad == 5 and len(padded) == 7
    assert padded["prompt"].tolist() == list("ababab") + ["a"]
    assert padded.unpad(pad).equals(b)
    same, zero = sample().pad_to_multiple(3)
    assert zero == 0 and same.equals(sample())
    empty, zero = b[:0].pad_to_multiple(4)
    assert zero == 0 and len(empty) == 0
    with pytest.raises(ValueError, match="pad_to_multiple: k must be >= 1"):
        b.pad_to_multiple(0)
    with pytest.raises(ValueError, match="pad_size must be between 0 and the Batch length 2"):
        b.unpad(3)
    with pytest.raises(ValueError, match="got -1"):
        b.unpad(-1)


def test_reorder():
    b = sample()
    r = b.reorder([5, 4, 3, 2, 1, 0])
    assert r["prompt"].tolist() == list("fedcba")
    assert r["ids"][:, 0].tolist() == [10, 8, 6, 4, 2, 0]
    assert b.reorder(torch.tensor([1, 0, 2, 3, 4, 5]))["prompt"].tolist()[:2] == ["b", "a"]
    with pytest.raises(ValueError, match="not a permutation of range"):
        b.reorder([0, 0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="permutation of range"):
        b.reorder([0, 1, 2, 3, 4, 6])
    with pytest.raises(ValueError, match="1-D permutation of length 6"):
        b.reorder([0, 1])
    with pytest.raises(TypeError, match="must hold integers"):
        b.reorder(np.arange(6, dtype=float))


# ---------------------------------------------------------------------------------- rows
def test_from_rows_and_rows():
    rows = [
        {"ids": torch.tensor([1, 2]), "prompt": "hi", "extra": {"k": 1}},
        {"ids": torch.tensor([3, 4]), "prompt": "yo", "extra": {"k": 2}},
    ]
    b = Batch.from_rows(rows, meta={"v": 1})
    assert b.tensor_keys == ["ids"] and b.non_tensor_keys == ["prompt", "extra"]
    assert b["ids"].tolist() == [[1, 2], [3, 4]] and b.meta == {"v": 1}
    back = list(b.rows())
    assert back[1]["prompt"] == "yo" and torch.equal(back[1]["ids"], torch.tensor([3, 4]))
    assert Batch.from_rows(back, meta={"v": 1}).equals(b)
    assert len(Batch.from_rows([])) == 0
    with pytest.raises(ValueError, match=r"row 1 has different keys.*missing \['extra'\]"):
        Batch.from_rows([rows[0], {"ids": rows[1]["ids"], "prompt": "x"}])
    with pytest.raises(ValueError, match="'ids' holds tensors of different shapes"):
        Batch.from_rows([rows[0], {**rows[1], "ids": torch.tensor([1])}])
    with pytest.raises(ValueError, match="'ids' mixes tensors and non-tensors"):
        Batch.from_rows([rows[0], {**rows[1], "ids": [3, 4]}])
    with pytest.raises(TypeError, match="row 0 is a list"):
        Batch.from_rows([[1, 2]])


def test_collate_with_dataloader():
    data = [{"x": torch.tensor([float(i)]), "name": f"n{i}"} for i in range(5)]
    loader = torch.utils.data.DataLoader(data, batch_size=2, collate_fn=collate)
    got = list(loader)
    assert [len(b) for b in got] == [2, 2, 1]
    assert got[1]["name"].tolist() == ["n2", "n3"] and got[2]["x"].tolist() == [[4.0]]


# ---------------------------------------------------------------------------------- copies
def test_to_clone_and_copies():
    import copy

    b = sample()
    moved = b.to("cpu")
    assert moved.equals(b) and moved["prompt"] is b["prompt"]
    c = b.clone()
    c["ids"][0, 0] = 100
    c["prompt"][0] = "changed"
    assert b["ids"][0, 0] == 0 and b["prompt"][0] == "a"
    shallow = copy.copy(b)
    assert shallow["ids"].data_ptr() == b["ids"].data_ptr()
    deep = copy.deepcopy(b)
    assert deep.equals(b) and deep["ids"].data_ptr() != b["ids"].data_ptr()
    deep["gt"][0]["answer"] = -1
    assert b["gt"][0] == {"answer": 0}


def test_equals_is_strict_about_dtype_and_meta():
    b = sample()
    assert b.equals(b.clone()) and not b.equals("b")
    other = b.clone()
    other["ids"] = other["ids"].int()
    assert not b.equals(other)
    other = b.clone()
    other.meta["weight_version"] = 4
    assert not b.equals(other)
    nan = Batch({"x": torch.tensor([float("nan"), 1.0])})
    assert nan.equals(nan.clone())


# ---------------------------------------------------------------------------------- pickling
def _buffer_address(buf: memoryview) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def test_pickle5_out_of_band_is_zero_copy_and_silent():
    b = sample()
    b["big"] = torch.randn(6, 1000)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    # One out-of-band buffer per tensor column; the pickle stream itself stays small.
    assert len(buffers) == len(b.tensor_keys)
    assert len(data) < 2000
    # Simulate a shared-memory store: immutable bytes, handed out as read-only views.
    stored = [bytes(buf.raw()) for buf in buffers]
    views = [memoryview(s) for s in stored]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's read-only-array warning would fail here
        got = pickle.loads(data, buffers=views)
    assert got.equals(b)
    addresses = {_buffer_address(v) for v in views}
    for key in got.tensor_keys:
        assert got[key].data_ptr() in addresses, f"{key} was copied on unpickle"
    assert got["lp"].dtype == torch.bfloat16
    writable = got.clone()
    writable["big"].add_(1)
    assert torch.equal(writable["big"], b["big"] + 1)


def test_pickle_noncontiguous_and_sliced_tensors():
    base = torch.arange(40, dtype=torch.float32).reshape(4, 10)
    b = Batch({"t": base.t()[:4], "s": base[1:3].repeat(2, 1)})
    got = pickle.loads(pickle.dumps(b, protocol=5))
    assert got.equals(b)
    view = Batch({"t": torch.arange(1000)})[10:12]
    assert len(pickle.dumps(view, protocol=5)) < 1000  # only the two rows travel


@settings(max_examples=30, deadline=None)
@given(batches())
def test_pickle_roundtrip_all_dtypes(b):
    for protocol in (4, 5):
        got = pickle.loads(pickle.dumps(b, protocol=protocol))
        assert got.equals(b)
        assert [got[k].dtype for k in got.tensor_keys] == [b[k].dtype for k in b.tensor_keys]
        assert got.keys() == b.keys()


# ---------------------------------------------------------------------------------- save/load
def test_save_load(tmp_path):
    b = sample()
    path = tmp_path / "b.pkl"
    b.save(path)
    got = Batch.load(path)
    assert got.equals(b)
    got["ids"][0, 0] = 7  # loaded tensors own writable memory
    b2 = b[:2]
    b2.save(str(path))  # overwrite
    assert len(Batch.load(path)) == 2
    assert sorted(os.listdir(tmp_path)) == ["b.pkl"]


def test_save_is_atomic_on_failure(tmp_path):
    path = tmp_path / "b.pkl"
    sample().save(path)
    broken = sample()
    broken["fn"] = [lambda: 0] * 6  # lambdas cannot be pickled
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        broken.save(path)
    assert Batch.load(path).equals(sample())
    assert sorted(os.listdir(tmp_path)) == ["b.pkl"]


def test_save_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sample().save(tmp_path / "missing" / "b.pkl")
    other = tmp_path / "other.pkl"
    other.write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(ValueError, match="is not a saved Batch"):
        Batch.load(other)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="is not a saved Batch"):
        Batch.load(garbage)


@settings(max_examples=30, deadline=None)
@given(batches())
def test_save_load_roundtrip(b):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "b.pkl")
        b.save(path)
        assert Batch.load(path).equals(b)


# ---------------------------------------------------------------------------------- properties
@settings(max_examples=30, deadline=None)
@given(batches(), st.integers(1, 9))
def test_chunk_concat_identity(b, n):
    parts = b.chunk(n, allow_empty=True)
    assert len(parts) == n
    sizes = [len(p) for p in parts]
    assert sum(sizes) == len(b) and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert Batch.concat(parts).equals(b)


@settings(max_examples=30, deadline=None)
@given(batches(), st.integers(1, 9))
def test_split_sizes_and_identity(b, size):
    parts = b.split(size)
    assert [len(p) for p in parts[:-1]] == [size] * (len(parts) - 1)
    if len(b):
        assert 1 <= len(parts[-1]) <= size
        assert Batch.concat(parts).equals(b)
    else:
        assert parts == []


@settings(max_examples=30, deadline=None)
@given(batches(), st.integers(1, 4), st.booleans())
def test_repeat_order(b, n, interleave):
    b["row"] = torch.arange(len(b))
    r = b.repeat(n, interleave=interleave)
    rows = np.arange(len(b))
    expected = np.repeat(rows, n) if interleave else np.tile(rows, n)
    assert r["row"].tolist() == expected.tolist()
    assert r.equals(b[expected])


@settings(max_examples=30, deadline=None)
@given(batches(), st.integers(1, 9))
def test_pad_unpad_identity(b, k):
    padded, pad = b.pad_to_multiple(k)
    assert len(padded) % k == 0 and 0 <= pad < k
    assert padded.unpad(pad).equals(b)
    if pad:
        assert padded[len(b) :].equals(b[np.arange(pad) % len(b)])


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_reorder_inverse_identity(data):
    b = data.draw(batches())
    perm = np.array(data.draw(st.permutations(range(len(b)))), dtype=np.int64)
    r = b.reorder(perm)
    assert r.equals(b[perm])
    assert r.reorder(np.argsort(perm)).equals(b)


def test_the_ray_actors_that_build_no_batch_do_not_import_tensordict():
    """tensordict imports torch._dynamo (~1.3 s of CPU), so Batch's module imports it on the
    first Batch built: the rollout replica's actor and the transfer queue's actors start sooner."""
    code = "import sys, polyrl.workers.rollout_replica, polyrl.transfer.ray_backend\n"
    code += "assert 'torch' in sys.modules and 'tensordict' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True)
