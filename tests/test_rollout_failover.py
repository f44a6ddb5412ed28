"""A replica lost mid-request: the client re-sends to the others, or waits for a restart.

Real replica processes on the tiny model; replicas are killed with SIGKILL, as a crash would.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from polyrl.rollout.client import NoReplicaAvailableError, RolloutClient
from polyrl.rollout.launcher import start_replicas

OPTIONS = {"num_threads": 1, "max_num_seqs": 64, "max_num_batched_tokens": 256}
GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}

pytestmark = pytest.mark.slow


@pytest.fixture
def two_replicas(tiny_qwen2_dir):
    procs = start_replicas(tiny_qwen2_dir, 2, options=OPTIONS, timeout=180)
    yield procs
    for p in procs:
        p.stop()


def _prompts(count: int) -> list[list[int]]:
    return [[i + 16, 9, 10, 11 + i % 5] for i in range(count)]


async def _generate_all(client: RolloutClient, prompts: list[list[int]]) -> list:
    return list(await asyncio.gather(*(client.generate(p, GREEDY) for p in prompts)))


def test_requests_in_flight_on_a_killed_replica_are_resent_whole(two_replicas):
    urls = [r.url for r in two_replicas]
    prompts = _prompts(32)

    async def reference():
        async with RolloutClient(urls, health_interval=0) as client:
            return await _generate_all(client, prompts)

    async def with_a_kill():
        async with RolloutClient(urls, health_interval=0.5, max_retries=2) as client:
            tasks = asyncio.ensure_future(_generate_all(client, prompts))
            while client.replicas[0].outstanding < 8:
                await asyncio.sleep(0.005)
            os.kill(two_replicas[0].process.pid, signal.SIGKILL)
            results = await tasks
            return results, client.retries

    expected = asyncio.run(reference())
    results, retries = asyncio.run(with_a_kill())
    assert len(results) == len(prompts)
    # Greedy and token-in/token-out: the re-sent requests give the tokens they would have.
    assert [r.outputs[0].output_ids for r in results] == [r.outputs[0].output_ids for r in expected]
    assert {r.replica for r in results} == {urls[1]}
    assert retries >= 8

    # With every replica gone the error names each one tried.
    async def none_left():
        async with RolloutClient(urls[:1], max_retries=1, health_interval=0) as client:
            await client.generate([1, 2], {"max_new_tokens": 2})

    with pytest.raises(NoReplicaAvailableError, match=urls[0].replace(".", r"\.")):
        asyncio.run(none_left())


def test_requests_wait_for_a_lone_replica_to_come_back(two_replicas):
    lone = two_replicas[0]
    old_url = lone.url
    prompts = _prompts(12)

    async def go():
        async with RolloutClient([old_url], health_interval=0.2, replica_wait=120) as client:
            expected = await _generate_all(client, prompts)
            tasks = asyncio.ensure_future(_generate_all(client, prompts))
            while client.replicas[0].outstanding < 4:
                await asyncio.sleep(0.005)
            os.kill(lone.process.pid, signal.SIGKILL)
            lone.process.wait()
            restarted: dict[str, str] = {}
            thread = threading.Thread(target=lambda: restarted.update(url=lone.restart(120)))
            thread.start()
            while thread.is_alive():
                await asyncio.sleep(0.05)
            if restarted["url"] != old_url:  # the old port was taken meanwhile
                client.replace_replica(old_url, restarted["url"])
            return expected, await tasks, restarted["url"], client.retries

    expected, results, new_url, retries = asyncio.run(go())
    assert [r.outputs[0].output_ids for r in results] == [r.outputs[0].output_ids for r in expected]
    assert {r.replica for r in results} == {new_url}
    assert retries >= 4
    assert "restarting the replica" in lone.log_tail()
