"""Tests of polyrl.transfer.fastpath: the controller's same-node socket for its hot calls."""

from __future__ import annotations

import asyncio
import os
import stat
import threading

import pytest
import torch
from waiting import wait_until

from polyrl.core.batch import Batch
from polyrl.transfer.base import TransferError
from polyrl.transfer.fastpath import FastPathClient, FastPathServer, FastPathUnavailable


class _Target:
    """Stands in for the controller: async methods named like the served ones."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.seen: list[tuple] = []
        self.waiting = 0  # calls blocked in get_meta_local now

    async def commit_new(self, *args):
        self.seen.append(args)
        self.event.set()
        return ("committed", args)

    async def get_meta_local(self, wait: bool, tag: str):
        if wait:
            self.waiting += 1
            try:
                await self.event.wait()
            finally:
                self.waiting -= 1
        if tag == "boom":
            raise TransferError("no such partition 'boom'")
        return ("meta", tag)

    async def clear(self, *args):  # exists, but is not served on the socket
        raise AssertionError("must not be reachable")


@pytest.fixture
def served():
    """A server on an event loop in a thread, as in the controller actor."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    target = _Target()
    server = FastPathServer(target)
    path = asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    yield target, server, path, loop

    async def shutdown():
        server.close()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()
        await asyncio.sleep(0.05)

    asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


@pytest.fixture
def ray_queue(ray_session):
    from polyrl.transfer import make_transfer_queue

    q = make_transfer_queue("ray", num_storage_units=2, block_size=64)
    yield q
    q.close()


def test_calls_results_and_errors_cross_the_socket(served):
    target, _, path, _ = served
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700  # private directory
    client = FastPathClient(path)
    assert client.call("commit_new", "p", [1, 2]) == ("committed", ("p", [1, 2]))
    assert client.call("get_meta_local", False, "x") == ("meta", "x")
    with pytest.raises(TransferError, match="no such partition 'boom'"):
        client.call("get_meta_local", False, "boom")
    with pytest.raises(TransferError, match="does not serve 'clear'"):
        client.call("clear", "p")
    assert client.call("get_meta_local", False, "y") == ("meta", "y")  # connection still good
    assert asyncio.run(client.acall("get_meta_local", False, "z")) == ("meta", "z")


def test_a_waiting_call_is_woken_by_a_call_from_another_thread(served):
    target, _, path, loop = served
    loop.call_soon_threadsafe(target.event.clear)
    client = FastPathClient(path)  # one connection per thread: the waiter does not block it
    out = {}
    waiter = threading.Thread(
        target=lambda: out.update(got=client.call("get_meta_local", True, "w"))
    )
    waiter.start()
    wait_until(lambda: target.waiting == 1, "the call waits on the server")
    assert waiter.is_alive()
    client.call("commit_new", "p")
    waiter.join(10)
    assert out["got"] == ("meta", "w")


def test_unreachable_server_and_broken_connection(served, tmp_path):
    with pytest.raises(FastPathUnavailable):
        FastPathClient(str(tmp_path / "nothing.sock")).call("commit_new")
    with pytest.raises(FastPathUnavailable):
        asyncio.run(FastPathClient(str(tmp_path / "nothing.sock")).acall("commit_new"))
    target, server, path, loop = served
    loop.call_soon_threadsafe(target.event.clear)
    client = FastPathClient(path)
    out = {}

    def wait():
        try:
            client.call("get_meta_local", True, "never")
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out["error"] = exc

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_until(lambda: target.waiting == 1, "the call waits on the server")
    # The controller goes away mid-call: the caller gets a clear error, not a hang.
    for task in asyncio.all_tasks(loop):
        loop.call_soon_threadsafe(task.cancel)
    waiter.join(10)
    assert isinstance(out.get("error"), TransferError), out
    assert "broke during 'get_meta_local'" in str(out["error"])


def test_ray_queue_uses_the_socket_and_falls_back_to_ray(ray_session, ray_queue):
    ray = ray_session
    from polyrl.transfer import RayTransferQueue

    q = RayTransferQueue.connect(ray_queue.name, direct_bytes=0)
    assert q.fast_path is not None and q.fast_path[1] == ray.get_runtime_context().get_node_id()
    b = Batch({"x": torch.arange(64 * 512).reshape(64, 512)})
    q.put(b, "fast")
    meta = q.get_meta(["x"], 64, "fast", "c", timeout=10)
    assert q._fast is not None and not q._fast_failed  # both calls went through the socket
    assert q.get_data(meta).equals(b)
    # A client that cannot reach the socket (say, another container on the node) uses Ray.
    lost = RayTransferQueue.connect(
        ray_queue.name, direct_bytes=0, fast_path=("/nonexistent/controller.sock", q.fast_path[1])
    )
    lost.put(b, "fast")
    meta = lost.get_meta(["x"], 64, "fast", "c2", timeout=10)
    assert lost._fast_failed and len(meta) == 64
    assert lost.get_data(meta)["x"].sum() == 2 * b["x"].sum() - b["x"].sum()  # same rows again
    q.clear("fast")
