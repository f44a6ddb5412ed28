"""Tests of polyrl.transfer.segments: shared-memory blocks between a producer and its readers."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from polyrl.core.batch import Batch
from polyrl.transfer._core import batch_to_columns, columns_to_batch
from polyrl.transfer.segments import SEGMENT_PREFIX, SegmentPool, map_block


def _batch(n: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(
        {
            "ids": torch.randint(0, 1000, (n, 7), generator=g),
            "logp": torch.randn(n, 7, generator=g),
            "half": torch.randn(n, 3, generator=g).to(torch.bfloat16),
            "flag": torch.rand(n, generator=g) > 0.5,
        },
        {"text": [f"row {i}" for i in range(n)], "ragged": [list(range(i % 4)) for i in range(n)]},
    )


def _read(block, fields=None) -> Batch | None:
    cols = map_block(block, fields)
    if cols is None:
        return None
    names = list(cols)
    return columns_to_batch(block.rows, [(list(range(block.rows)), cols)], names)


@pytest.fixture
def pool(tmp_path: Path) -> SegmentPool:
    p = SegmentPool(tmp_path)
    yield p
    p.close()


def test_sealed_block_reads_back_exactly_and_reader_writes_stay_private(pool):
    b = _batch(9)
    block, seg = pool.seal(batch_to_columns(b), node="n0")
    pool.settle(seg)
    assert block.rows == 9 and set(block.fields) == set(b.keys())
    got = _read(block)
    assert got.equals(b)
    got["logp"].mul_(0)  # in place: copy-on-write, other readers still see the block
    assert torch.all(got["logp"] == 0)
    assert _read(block).equals(b)
    only = _read(block, ["half"])
    assert list(only.keys()) == ["half"] and torch.equal(only["half"], b["half"])


def test_segment_is_reused_only_once_nobody_maps_it(pool):
    first, seg = pool.seal(batch_to_columns(_batch(16, seed=1)), node="n0")
    # Not adopted yet (not settled): a second put must not reuse it, mapped or not.
    second, seg2 = pool.seal(batch_to_columns(_batch(16, seed=2)), node="n0")
    assert second.path != first.path
    pool.settle(seg)
    pool.settle(seg2)
    held = _read(first)  # a reader holds views of the first block
    third, seg3 = pool.seal(batch_to_columns(_batch(16, seed=3)), node="n0")
    pool.settle(seg3)
    assert third.path == second.path  # the free one, not the one still mapped
    assert held.equals(_batch(16, seed=1))
    del held
    fourth, seg4 = pool.seal(batch_to_columns(_batch(16, seed=4)), node="n0")
    pool.settle(seg4)
    assert fourth.path == first.path and fourth.generation == first.generation + 1
    # The old descriptor names a segment that now holds another block: nothing is read.
    assert map_block(first) is None
    assert _read(fourth).equals(_batch(16, seed=4))
    assert pool.nbytes() == seg.size + seg2.size  # two segments served four puts


def test_idle_segments_beyond_a_few_are_removed(pool, tmp_path):
    blocks = []
    for k in range(8):
        blocks.append(pool.seal(batch_to_columns(_batch(8 + 50 * k, seed=k)), node="n0"))
    for _, seg in blocks:
        pool.settle(seg)
    assert len(list(tmp_path.glob(SEGMENT_PREFIX + "*"))) == 8
    pool.seal(batch_to_columns(_batch(4)), node="n0")
    # One reused, four kept idle, the rest removed.
    assert len(list(tmp_path.glob(SEGMENT_PREFIX + "*"))) == 5


def test_a_removed_segment_is_not_read_but_existing_views_survive(pool):
    block, seg = pool.seal(batch_to_columns(_batch(5)), node="n0")
    pool.settle(seg)
    held = _read(block)
    pool.close()  # the producer exits: its files are removed
    assert map_block(block) is None
    assert held.equals(_batch(5))  # the mapping keeps the pages of the views it gave


def test_no_room_for_a_segment_falls_back(pool, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    # A full tmpfs cannot be made here without root; this fakes its fallocate error.
    monkeypatch.setattr(os, "posix_fallocate", full)
    assert pool.seal(batch_to_columns(_batch(3)), node="n0") is None
    assert not list(pool.root.glob(SEGMENT_PREFIX + "*"))


def test_segments_of_a_killed_producer_are_swept(tmp_path):
    code = (
        "import os, sys, torch\n"
        "from pathlib import Path\n"
        "from polyrl.core.batch import Batch\n"
        "from polyrl.transfer._core import batch_to_columns\n"
        "from polyrl.transfer.segments import SegmentPool\n"
        "pool = SegmentPool(Path(sys.argv[1]))\n"
        "pool.seal(batch_to_columns(Batch({'x': torch.ones(4, 4)})), node='n')\n"
        "os._exit(0)\n"  # no atexit: as if killed
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    assert len(list(tmp_path.glob(SEGMENT_PREFIX + "*"))) == 1
    SegmentPool(tmp_path).close()  # a new pool sweeps files of dead producers
    assert not list(tmp_path.glob(SEGMENT_PREFIX + "*"))


def test_round_size_bounds_slack():
    from polyrl.transfer.segments import _round_size

    for n in [1, 1000, 65_536, 65_537, 1 << 20, (1 << 20) + 1, 20_971_520 + 64, 3 * 10**8]:
        size = _round_size(n)
        assert size >= n and (size - n) <= max(1 << 16, n // 8), n
    assert np.all(np.diff([_round_size(n) for n in range(1, 10**6, 997)]) >= 0)


def test_sweep_segments_removes_only_files_of_dead_processes(tmp_path, monkeypatch):
    from polyrl.transfer.segments import SEGMENT_DIR_ENV, sweep_segments

    monkeypatch.setenv(SEGMENT_DIR_ENV, str(tmp_path))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    gone = tmp_path / f"{SEGMENT_PREFIX}{int(dead.stdout)}-abc"
    alive = tmp_path / f"{SEGMENT_PREFIX}{os.getpid()}-def"
    gone.write_bytes(b"x")
    alive.write_bytes(b"y")
    assert sweep_segments() == 1
    assert not gone.exists() and alive.exists()
