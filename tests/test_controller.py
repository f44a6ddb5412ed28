"""Single controller: real Ray actors (and the local backend), real gloo, real processes."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.controller import (
    ControllerError,
    ControllerFuture,
    DataParallelLayout,
    Dispatch,
    DispatchError,
    DispatchMode,
    DriverTrafficMeter,
    Execute,
    ResourcePool,
    ResourcePoolError,
    ResourcePoolManager,
    ShardedFuture,
    Worker,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerSpec,
    register,
    register_dispatch_mode,
)
from polyrl.controller.worker_group import pid_alive
from polyrl.core.batch import Batch

BACKENDS = ["ray", "local"]


# ----------------------------------------------------------------------------------------------
# Workers used by the tests (module level: the local backend pickles classes by reference)
# ----------------------------------------------------------------------------------------------
def _swap_dispatch(ctx, args, kwargs):
    # Rank i receives item (world - 1 - i) of each list argument.
    n = ctx.world_size
    return [(tuple(a[n - 1 - r] for a in args), {}) for r in range(n)]


def _sum_collect(ctx, results):
    return sum(results)


SWAP = register_dispatch_mode("test_swap_sum", _swap_dispatch, _sum_collect, overwrite=True)


class MathWorker(Worker):
    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset
        self.log: list[str] = []
        self.last_len = -1
        # Everyone gets the whole batch, only rank 0 returns (dp=1 x tp=world).
        self.register_mesh("pairs", {"dp": 1, "tp": self.world_size})

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "node_id": self.node_id,
            "device": str(self.device),
            "pid": os.getpid(),
            "dist_backend": self.dist_backend,
            "dist_rank": dist.get_rank(),
            "env_rank": os.environ.get("RANK"),
            "master_port": os.environ.get("MASTER_PORT"),
            "threads": torch.get_num_threads(),
            "omp_env": os.environ.get("OMP_NUM_THREADS"),
        }

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float) -> float:
        t = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(t)
        return float(t.item())

    @register(dispatch=Dispatch.ALL_TO_ALL)
    def scale(self, x: float, factor: float) -> float:
        return x * factor + 1000 * self.rank

    @register(dispatch=Dispatch.RANK_ZERO)
    def rank_zero_only(self) -> tuple[int, int]:
        return self.rank, os.getpid()

    @register(dispatch=Dispatch.ONE_TO_ALL, execute=Execute.RANK_ZERO)
    def executed_on_rank0(self) -> int:
        return self.rank

    @register(dispatch=Dispatch.DP_COMPUTE)
    def double(self, batch: Batch, bias: float = 0.0) -> Batch:
        self.last_len = len(batch)
        return Batch(
            {
                "y": batch["x"] * 2 + self.offset + bias,
                "rank": torch.full((len(batch),), self.rank),
            },
            non_tensors={k: v for k, v in batch.non_tensors.items() if k == "tag"},
        )

    @register(dispatch=Dispatch.DP_COMPUTE)
    def repeat2(self, batch: Batch) -> Batch:
        return batch.repeat(2)

    @register(dispatch=Dispatch.DP_COMPUTE, blocking=False)
    def add_one(self, batch: Batch) -> Batch:
        self.last_len = len(batch)
        return Batch({"x": batch["x"] + 1})

    @register(dispatch=Dispatch.DP_COMPUTE, mesh="pairs", blocking=False)
    def mesh_add_ten(self, batch: Batch) -> Batch:
        self.last_len = len(batch)
        return Batch({"x": batch["x"] + 10, "rank": torch.full((len(batch),), self.rank)})

    @register(dispatch=Dispatch.DP_COMPUTE, blocking=False)
    def row_sum(self, batch: Batch) -> Batch:
        return Batch({"s": batch["x"].sum(-1)})

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def metrics(self, batch: Batch) -> dict:
        return {"mean_x": float(batch["x"].float().mean()), "rows": [len(batch)]}

    @register(dispatch="test_swap_sum")
    def ident(self, value: int) -> int:
        return value * 10 + self.rank

    @register
    def last_seen_len(self) -> int:
        return self.last_len

    @register
    def fail_on(self, bad_rank: int) -> int:
        if self.rank == bad_rank:
            raise ValueError(f"boom from rank {self.rank}")
        return self.rank

    @register
    def fail_before_collective(self, bad_rank: int) -> float:
        if self.rank == bad_rank:
            raise RuntimeError(f"rank {self.rank} skips the all_reduce")
        t = torch.ones(1)
        dist.all_reduce(t)  # the other ranks now wait here for a peer that never comes
        return float(t.item())

    @register(blocking=False)
    def fail_on_async(self, bad_rank: int) -> Batch:
        if self.rank == bad_rank:
            raise KeyError(f"async boom from rank {self.rank}")
        return Batch({"x": torch.arange(4.0)})

    @register(blocking=False)
    def record(self, tag: str, *deps: object) -> str:
        self.log.append(tag)
        return tag

    @register
    def get_log(self) -> list[str]:
        return list(self.log)

    @register(blocking=False)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


class MeshWorker(Worker):
    @register(dispatch=Dispatch.DP_COMPUTE, mesh="train")
    def tag_rows(self, batch: Batch) -> Batch:
        return Batch({"x": batch["x"], "rank": torch.full((len(batch),), self.rank)})

    @register
    def declare(self) -> tuple[int, int, bool]:
        self.register_mesh("train", {"dp": 2, "tp": 2})
        return self.dispatch_info("train")

    @register
    def tp_all_reduce(self, value: float) -> float:
        t = torch.tensor([value])
        dist.all_reduce(t)
        return float(t.item())


class ActorRole(Worker):
    def __init__(self) -> None:
        self.weights = torch.arange(4.0)

    @register
    def weights_ptr(self) -> tuple[int, int]:
        return os.getpid(), self.weights.data_ptr()

    @register
    def bump(self, value: float) -> list[float]:
        self.weights += value
        return self.weights.tolist()


class RefRole(Worker):
    @register
    def peer_view(self) -> tuple[int, int, list[float], str]:
        weights = self.colocated("actor").weights
        return os.getpid(), weights.data_ptr(), weights.tolist(), self.role


# ----------------------------------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------------------------------
def make_group(request, backend: str, workers, world: int = 2, **kwargs) -> WorkerGroup:
    if backend == "ray":
        request.getfixturevalue("ray_session")
        pool = ResourcePool(f"test-{backend}", world, cpus_per_worker=0.5)
        request.addfinalizer(pool.release)  # a pool passed in stays the caller's to release
        return WorkerGroup(workers, pool=pool, backend="ray", **kwargs)
    return WorkerGroup(workers, world_size=world, backend="local", **kwargs)


@pytest.fixture(scope="module", params=BACKENDS)
def group(request):
    g = make_group(request, request.param, WorkerSpec(MathWorker, (0.5,)), dead_worker_timeout_s=20)
    yield g
    g.shutdown()


def make_batch(n: int, width: int = 1) -> Batch:
    x = torch.arange(n * width, dtype=torch.float32).reshape(n, width).squeeze(-1)
    return Batch({"x": x}, non_tensors={"tag": [f"row{i}" for i in range(n)]})


# ----------------------------------------------------------------------------------------------
# Basics: placement, distributed init, dispatch modes
# ----------------------------------------------------------------------------------------------
def test_workers_know_rank_and_share_a_runtime_rendezvous(group):
    info = group.whoami()
    assert [i["rank"] for i in info] == [0, 1]
    assert [i["dist_rank"] for i in info] == [0, 1]
    assert [i["env_rank"] for i in info] == ["0", "1"]
    assert all(i["world_size"] == 2 and i["dist_backend"] == "gloo" for i in info)
    assert all(i["device"] == "cpu" for i in info)
    assert len({i["pid"] for i in info}) == 2 and os.getpid() not in {i["pid"] for i in info}
    ports = {i["master_port"] for i in info}
    assert len(ports) == 1 and int(ports.pop()) > 0
    assert [w.pid for w in group.worker_info] == [i["pid"] for i in info]
    assert sorted(w.local_rank for w in group.worker_info) == [0, 1]
    assert group.check_health() == [i["pid"] for i in info]
    if group.backend == "local" and info[0]["omp_env"] is None:
        # Two spawned ranks on this node share its cores instead of each taking all of them.
        cores = len(os.sched_getaffinity(0))
        assert [i["threads"] for i in info] == [max(1, cores // 2)] * 2


def test_gloo_all_reduce_across_the_group(group):
    assert group.all_reduce(1.0) == [3.0, 3.0]
    assert group.all_reduce(2.5) == [7.5, 7.5]


def test_all_to_all_and_rank_zero(group):
    assert group.scale([1.0, 2.0], factor=[10.0, 100.0]) == [10.0, 1200.0]
    rank, pid = group.rank_zero_only()
    assert rank == 0 and pid == group.worker_info[0].pid
    assert group.executed_on_rank0() == [0]
    with pytest.raises(DispatchError, match="one item per rank"):
        group.scale([1.0], factor=[1.0, 2.0])


def test_user_registered_dispatch_mode(group):
    # rank 0 gets 2, rank 1 gets 1 -> (2*10 + 0) + (1*10 + 1)
    assert group.ident([1, 2]) == 31
    assert SWAP.name == "test_swap_sum"


@settings(max_examples=12, deadline=None)
@given(n=st.integers(min_value=1, max_value=9), bias=st.sampled_from([0.0, 3.0]))
def test_dp_compute_keeps_order_when_length_does_not_divide(group, n, bias):
    batch = make_batch(n)
    out = group.double(batch, bias=bias)
    assert len(out) == n
    torch.testing.assert_close(out["y"], batch["x"] * 2 + 0.5 + bias)
    assert list(out.non_tensors["tag"]) == [f"row{i}" for i in range(n)]
    # Contiguous shards: the first ceil(n/2) rows went to rank 0.
    half = (n + 1) // 2
    assert out["rank"].tolist() == [0] * half + [1] * (n - half)


def test_dp_compute_drops_padding_for_k_rows_per_input(group):
    batch = make_batch(5)
    out = group.repeat2(batch)
    assert out["x"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_dp_compute_metric_reduces_dicts(group):
    metrics = group.metrics(make_batch(4))
    assert metrics == {"mean_x": pytest.approx((0.5 + 2.5) / 2), "rows": [2, 2]}


def test_dp_compute_rejects_mismatched_batches(group):
    with pytest.raises(DispatchError, match="different lengths"):
        group.invoke(
            "double",
            (make_batch(3),),
            {"bias": make_batch(4)},
            dispatch=Dispatch.DP_COMPUTE,
        )


# ----------------------------------------------------------------------------------------------
# Futures
# ----------------------------------------------------------------------------------------------
def test_three_call_chain_keeps_data_off_the_driver(group):
    n, width = 512, 256  # 512 KiB payload: every intermediate is far above Ray's inline limit
    batch = make_batch(n, width)
    payload = batch["x"].numel() * 4
    if group.backend == "ray":
        meter = DriverTrafficMeter()
        with meter:
            a = group.add_one(batch)
            b = group.add_one(a)
            c = group.row_sum(b)
            assert isinstance(a, ShardedFuture) and isinstance(c, ControllerFuture)
            out = c.get()
        intermediate = {h.hex() for f in (a, b) for h in f.handles()}
        assert not intermediate & meter.fetched_ids
        final = {h.hex() for h in c.handles()}
        assert final <= meter.fetched_ids
        # Only the final row sums (n floats) plus small control data came back.
        assert meter.deserialized_bytes >= n * 4
        assert meter.total_bytes < payload * 0.02
        # The driver sent the batch once (split over the ranks), never the intermediates.
        assert payload <= meter.sent_bytes < payload * 1.1
    else:
        a = group.add_one(batch)
        out = group.row_sum(group.add_one(a)).get()
    torch.testing.assert_close(out["s"], (batch["x"] + 2).sum(-1))


def test_future_chain_through_a_different_layout_is_resplit(group):
    batch = make_batch(5)
    meshed = group.mesh_add_ten(batch)  # dp=1: both ranks get everything, rank 0 answers
    assert group.last_seen_len() == [5, 5]
    out = meshed.get()
    assert out["rank"].tolist() == [0] * 5
    torch.testing.assert_close(out["x"], batch["x"] + 10)
    # dp=1 result -> dp=2 consumer: re-split off the driver, padding handled.
    if group.backend == "ray":
        with DriverTrafficMeter() as meter:
            upstream = group.mesh_add_ten(batch)
            again = group.double(upstream)
        # The data (rank 0's shard) never came to the driver; rank 1's discarded result is a
        # None the driver does read, to surface a failure there.
        assert not {h.hex() for h in upstream.shard_handles()} & meter.fetched_ids
    else:
        again = group.double(group.mesh_add_ten(batch))
    torch.testing.assert_close(again["y"], (batch["x"] + 10) * 2 + 0.5)
    assert group.last_seen_len() == [3, 3]
    # dp=2 result -> dp=1 consumer.
    back = group.mesh_add_ten(group.add_one(batch)).get()
    torch.testing.assert_close(back["x"], batch["x"] + 11)


def test_future_passed_whole_and_get_is_cached(group):
    fut = group.add_one(make_batch(3))
    # Same layout: the padded shards [1, 2] and [3, 1] go straight on, padding row included.
    assert group.metrics(fut) == {"mean_x": pytest.approx((1.5 + 2.0) / 2), "rows": [2, 2]}
    first = fut.get()
    assert fut.get() is first and fut.done()


def test_calls_run_in_submission_order_on_each_rank(group):
    slow = group.sleep(0.5)
    first = group.record("first", slow)  # waits on the sleep's result
    second = group.record("second")
    assert second.get() == ["second", "second"] and first.get() == ["first", "first"]
    assert [log[-2:] for log in group.get_log()] == [["first", "second"]] * 2


# ----------------------------------------------------------------------------------------------
# Failures
# ----------------------------------------------------------------------------------------------
def test_rank_exception_is_readable_in_the_driver(group):
    with pytest.raises(WorkerError) as info:
        group.fail_on(1)
    err = info.value
    assert err.rank == 1 and err.method == "fail_on" and err.exc_type == "ValueError"
    text = str(err)
    assert "fail_on failed on rank 1" in text and "boom from rank 1" in text
    assert "test_controller.py" in err.remote_traceback and "in fail_on" in err.remote_traceback
    assert group.fail_on(-1) == [0, 1]  # the group is still usable


def test_error_travels_through_a_future_chain(group):
    broken = group.fail_on_async(0)
    chained = group.row_sum(broken)
    with pytest.raises(WorkerError) as info:
        chained.get()
    assert info.value.rank == 0 and info.value.method == "fail_on_async"
    assert "async boom from rank 0" in str(info.value)


def test_unknown_or_conflicting_registrations_fail_before_start():
    class Bad(Worker):
        @register(dispatch="no_such_mode")
        def f(self) -> None:
            return None

    with pytest.raises(ValueError, match="unknown dispatch mode 'no_such_mode'"):
        WorkerGroup(Bad, world_size=1, backend="local")

    class Clash(Worker):
        @register
        def shutdown(self) -> None:
            return None

    with pytest.raises(ValueError, match="clashes"):
        WorkerGroup(Clash, world_size=1, backend="local")
    with pytest.raises(ValueError, match="execute=RANK_ZERO"):
        register(dispatch=Dispatch.DP_COMPUTE, execute=Execute.RANK_ZERO)
    with pytest.raises(ValueError, match="backend must be one of"):
        WorkerGroup(MathWorker, world_size=1, backend="mpi")


def test_worker_outside_a_group_is_rank_zero_of_one():
    worker = MathWorker(2.0)
    assert (worker.rank, worker.world_size, worker.local_rank) == (0, 1, 0)
    assert worker.device == torch.device("cpu") and worker.dispatch_info("pairs") == (0, 1, True)
    with pytest.raises(KeyError, match="declared no mesh 'nope'"):
        worker.dispatch_info("nope")
    with pytest.raises(ValueError, match="has 4 ranks but the group has world_size 1"):
        worker.register_mesh("bad", {"dp": 2, "tp": 2})


def test_layout_validation():
    layout = DataParallelLayout.from_rank_infos("m", [(0, 2, True), (0, 2, False), (1, 2, True)])
    assert layout.collect_rank == (0, 2) and layout.dp_rank == (0, 0, 1)
    with pytest.raises(DispatchError, match="no collect rank"):
        DataParallelLayout.from_rank_infos("m", [(0, 2, True), (1, 2, False)])
    with pytest.raises(DispatchError, match="both the collect rank"):
        DataParallelLayout.from_rank_infos("m", [(0, 1, True), (0, 1, True)])


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_and_stopped_workers_are_reported_and_shutdown_cleans_up(request, backend):
    group = make_group(
        request,
        backend,
        MathWorker,
        dead_worker_timeout_s=2.0,
        health_check_interval_s=0.25,
        call_timeout_s=4.0,
    )
    pids = [w.pid for w in group.worker_info]
    assert all(pid_alive(p) for p in pids)
    try:
        # One rank raises while the other blocks in a collective: the error still comes back
        # promptly instead of the driver waiting on the blocked rank.
        start = time.monotonic()
        with pytest.raises(WorkerError, match="skips the all_reduce") as err:
            group.fail_before_collective(1)
        assert err.value.rank == 1 and time.monotonic() - start < 5.0
        # A rank stuck in a call but answering pings: dead once call_timeout_s has passed.
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            group.sleep(5.0).get()
        assert 4.0 <= time.monotonic() - start < 4.0 + 3.0
        assert "call_timeout_s=4" in info.value.reason and "hung" in info.value.reason
        assert info.value.method == "sleep" and info.value.pid == pids[info.value.rank]
        # A stopped (hung) rank: alive as a process but answering nothing.
        busy = group.sleep(60)
        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            busy.get()
        assert info.value.rank == 1 and "health check" in str(info.value)
        assert time.monotonic() - start < 2.0 + 3.0
        # A killed rank: reported as soon as the process is gone, well within the timeout.
        os.kill(pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            group.fail_on(-1)
        assert info.value.rank == 0 and info.value.method == "fail_on"
        # Where it ran, for the run's message.
        rank0 = group.worker_info[0]
        assert (info.value.pid, info.value.node_id) == (pids[0], rank0.node_id)
        assert f"pid {pids[0]} on node {rank0.node_ip}" in info.value.where
        assert time.monotonic() - start < 2.0 + 3.0
    finally:
        group.shutdown()
    assert not [p for p in pids if pid_alive(p)]
    with pytest.raises(ControllerError, match="shut down"):
        group.whoami()
    group.shutdown()  # idempotent


# ----------------------------------------------------------------------------------------------
# Colocation, pools, meshes
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_colocated_roles_share_one_process_and_tensor(request, backend):
    if backend == "ray":
        request.getfixturevalue("ray_session")
        manager = ResourcePoolManager(
            [
                ResourcePool("colo", 2, cpus_per_worker=0.5),
                ResourcePool("solo", 1, cpus_per_worker=0.5),
            ],
            {"actor": "colo", "ref": "colo", "critic": "solo"},
        )
        views = manager.create_worker_groups(
            {"actor": ActorRole, "ref": RefRole, "critic": MathWorker}, backend="ray"
        )
        group = views["actor"].group
        assert views["ref"].group is group
        # The critic has a pool (and process) of its own.
        critic = views["critic"]
        assert critic.group is not group and critic.world_size == 1
        assert critic.all_reduce(2.0) == [2.0]
        critic_pid = critic.group.worker_info[0].pid
        assert critic_pid not in {w.pid for w in group.worker_info}
    else:
        manager = None
        group = WorkerGroup({"actor": ActorRole, "ref": RefRole}, world_size=2, backend="local")
        views = {"actor": group.role("actor"), "ref": group.role("ref")}
    try:
        assert group.roles == ("actor", "ref")
        actor = group.actor_weights_ptr()
        ref = group.ref_peer_view()
        for (apid, aptr), (rpid, rptr, _, role) in zip(actor, ref, strict=True):
            assert apid == rpid and aptr == rptr and role == "ref"
        assert views["actor"].bump(1.0) == [[1.0, 2.0, 3.0, 4.0]] * 2
        assert [r[2] for r in views["ref"].peer_view()] == [[1.0, 2.0, 3.0, 4.0]] * 2
        with pytest.raises(AttributeError, match="registered"):
            views["ref"].bump  # noqa: B018 - the actor's method is not the ref role's
    finally:
        if manager is not None:
            manager.shutdown()
        else:
            group.shutdown()


def test_local_backend_world_of_one_runs_inline():
    group = WorkerGroup(WorkerSpec(MathWorker, (1.0,)), world_size=1, backend="local")
    try:
        (info,) = group.whoami()
        assert info["pid"] == os.getpid() and info["rank"] == 0
        assert group.all_reduce(2.0) == [2.0]
        out = group.double(make_batch(3))
        assert out["y"].tolist() == [1.0, 3.0, 5.0]
        with pytest.raises(WorkerError, match="boom from rank 0"):
            group.fail_on(0)
    finally:
        group.shutdown()


class EnvWorker(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def env(self, name: str) -> tuple[str | None, int]:
        return os.environ.get(name), torch.get_num_threads()


def test_local_ranks_get_the_drivers_environment_of_when_they_start(monkeypatch):
    # CPU ranks fork from a fork server started once: each still gets the driver's environment
    # as it is when its group starts (an OpenMP thread count too), not the server's.
    monkeypatch.delenv("POLYRL_TEST_RANK_ENV", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = WorkerGroup(WorkerSpec(EnvWorker), world_size=2, backend="local")
    try:
        monkeypatch.setenv("POLYRL_TEST_RANK_ENV", "set")
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        after = WorkerGroup(WorkerSpec(EnvWorker), world_size=2, backend="local")
        try:
            assert after.env("POLYRL_TEST_RANK_ENV") == [("set", 3)] * 2
            assert [value for value, _ in before.env("POLYRL_TEST_RANK_ENV")] == [None, None]
        finally:
            after.shutdown()
    finally:
        before.shutdown()


def test_infeasible_pool_fails_with_a_clear_error(ray_session):
    pool = ResourcePool("too-big", 2, cpus_per_worker=64, ready_timeout_s=1.0)
    with pytest.raises(ResourcePoolError, match="could not reserve 2 x"):
        WorkerGroup(MathWorker, pool=pool)
    assert not pool.is_reserved


class PidWorker(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


@pytest.mark.slow
def test_a_dead_rank_is_replaced_in_its_bundle_and_called_alone(ray_session):
    pool = ResourcePool("replace", 2, cpus_per_worker=0.5)
    group = WorkerGroup(PidWorker, pool=pool, init_distributed=False)
    try:
        first, second = group.pid()
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while group.rank_alive(0, timeout=2.0):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert group.call_rank(1, "pid") == second  # the other rank answers on its own
        with pytest.raises(WorkerDiedError):
            group.call_rank(0, "pid", timeout=30)
        info = group.replace_rank(0, 60)
        assert group.rank_alive(0) and info.pid not in (first, second)
        assert group.pid() == [info.pid, second]
    finally:
        group.shutdown()
        pool.release()
    distributed = WorkerGroup(PidWorker, world_size=1)
    try:
        with pytest.raises(ControllerError, match="cannot be replaced alone"):
            distributed.replace_rank(0, 10)
    finally:
        distributed.shutdown()


def test_resource_pool_validation():
    with pytest.raises(ValueError, match="strategy"):
        ResourcePool("p", 2, strategy="RANDOM")
    with pytest.raises(ValueError, match="num_workers"):
        ResourcePool("p", 0)
    with pytest.raises(ValueError, match="some resource"):
        ResourcePool("p", 1, cpus_per_worker=0)
    pool = ResourcePool("p", 2, cpus_per_worker=2, gpus_per_worker=1, max_colocate_count=2)
    assert pool.bundle() == {"CPU": 2.0, "GPU": 1.0}
    assert pool.actor_resources() == {"num_cpus": 1.0, "num_gpus": 0.5}
    with pytest.raises(ValueError, match="unknown pool"):
        ResourcePoolManager([pool], {"actor": "nope"})


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_dp_by_tp_mesh_sends_shards_to_groups_and_collects_once(request, backend):
    group = make_group(request, backend, MeshWorker, world=4)
    try:
        assert group.declare() == [(0, 2, True), (0, 2, False), (1, 2, True), (1, 2, False)]
        batch = make_batch(5)
        out = group.tag_rows(batch)
        torch.testing.assert_close(out["x"], batch["x"])
        # Rows 0-2 from dp group 0 (collect rank 0), rows 3-4 from dp group 1 (collect rank 2).
        assert out["rank"].tolist() == [0, 0, 0, 2, 2]
        assert group.tp_all_reduce(1.0) == [4.0] * 4
    finally:
        group.shutdown()


def test_dispatch_mode_object_can_be_used_directly(group):
    mode = DispatchMode(
        "direct_first_rank",
        lambda ctx, args, kwargs: [(args, kwargs)] + [None] * (ctx.world_size - 1),
        lambda ctx, results: results[0],
    )
    assert group.invoke("ident", (4,), dispatch=mode) == 40


def test_batch_arguments_are_not_mutated(group):
    batch = make_batch(4)
    before = batch["x"].clone()
    group.double(batch)
    assert torch.equal(batch["x"], before)
    assert isinstance(np.asarray(batch.non_tensors["tag"]), np.ndarray)
