"""The SWE environment: generated repositories, tools in the sandbox, reward from the tests."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path

import pytest

from polyrl.agent.swe_env import SWEEnv, make_repo, swe_rows

# Small limits keep each sandboxed call quick.
FAST = {"timeout": 8.0, "memory_mb": 512, "disk_mb": 8, "max_procs": 16}


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def episode(actions, split="train", index=0):
    """Run ``actions`` (turn texts) on repository ``index``; return the step results."""

    async def main():
        env = SWEEnv(**FAST, max_steps=len(actions))
        env.reset(split=split, index=index)
        out = []
        for a in actions:
            out.append(await env.step(a))
            if out[-1][2]:
                break
        return env, out

    return asyncio.run(main())


def host_processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def test_repos_are_deterministic_and_the_splits_disjoint():
    a, b = make_repo("train", 3), make_repo("train", 3)
    assert a == b and a.fix and len(a.tests) == 9
    train = {json.dumps(make_repo("train", i).files, sort_keys=True) for i in range(30)}
    held = {json.dumps(make_repo("heldout", i).files, sort_keys=True) for i in range(30)}
    assert len(train) > 20 and not train & held
    rows = swe_rows("heldout", 2)
    assert rows[1]["extra_info"]["env_kwargs"] == {"split": "heldout", "index": 1}


def test_the_right_patch_scores_one_and_a_wrong_one_less():
    task = make_repo("train", 0)
    ((path, fixed),) = task.fix.items()
    env, results = episode([call("read_file", path=path), call("run_tests")])
    assert "def " in results[0][0] and "failed" in results[1][0] and "passed" in results[1][0]
    _, results = episode([call("write_file", path=path, content=fixed), call("submit")])
    obs, reward, done, info = results[-1]
    assert done and reward == 1.0 and info["solved"] == 1.0, obs
    _, results = episode([call("run_tests"), call("submit")])
    assert 0.0 < results[-1][1] < 1.0  # the buggy repository passes some tests, not all


def test_apply_patch_and_bash_edits_reach_the_score():
    task = make_repo("train", 1)
    ((path, fixed),) = task.fix.items()
    original = task.files[path]
    # The one line that differs, as an exact replacement.
    old = next(a for a, b in zip(original.splitlines(), fixed.splitlines(), strict=True) if a != b)
    new = fixed.splitlines()[original.splitlines().index(old)]
    _, results = episode(
        [call("apply_patch", path=path, old=old, new=new), call("submit")], index=1
    )
    assert results[-1][1] == 1.0
    script = f"cat > {path} <<'EOF'\n{fixed}EOF\n"
    _, results = episode([call("bash", command=script), call("submit")], index=1)
    assert results[-1][1] == 1.0, results


def test_deleting_or_rewriting_the_tests_scores_zero():
    task = make_repo("train", 2)
    test_file = next(p for p in task.files if p.startswith("tests/"))
    _, results = episode([call("bash", command="rm -rf tests"), call("submit")], index=2)
    assert results[-1][1] == 0.0
    fake = "def test_x():\n    pass\n"
    _, results = episode(
        [call("write_file", path=test_file, content=fake), call("submit")], index=2
    )
    assert results[-1][1] == 0.0


def test_reads_and_writes_outside_the_copy_fail(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    target = tmp_path / "written.txt"
    env, results = episode(
        [
            call("read_file", path=str(secret)),
            call("read_file", path="../../../" + str(secret)),
            call("write_file", path="../escape.py", content="x"),
            call("bash", command=f"cat {secret}; echo pwned > {target}; ls /work /home"),
        ]
    )
    assert all(r[0].startswith("Error") for r in results[:3]), results
    assert "host secret" not in results[3][0]
    assert not target.exists()
    assert all(".." not in p and not p.startswith("/") for p in env.files)


def test_no_network_and_no_process_left_behind():
    marker = f"polyrl-swe-{uuid.uuid4().hex}"
    net = (
        'python3 -c "import socket; s=socket.socket(); s.settimeout(2); '
        "s.connect(('127.0.0.1', 22)); print('connected')\""
    )
    _, results = episode(
        [
            call("bash", command=net),
            call("bash", command=f"(sleep 300; echo {marker}) > /dev/null 2>&1 & echo started"),
        ]
    )
    assert "connected" not in results[0][0] and "exit code 0" not in results[0][0], results[0]
    assert "started" in results[1][0]
    assert host_processes_with(marker) == []


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_the_env_loop_runs_an_swe_episode(split, agent_server, tiny_qwen2_tokenizer):
    """Through the env loop on a real server: the random model's turns call no tool, so the
    loop's turn limit ends the episode and the environment scores the buggy code then."""
    from polyrl.agent import run_agent_loops
    from polyrl.agent.envs import ENVS
    from polyrl.rollout.client import RolloutClient

    assert "swe" in ENVS.names()
    rows = swe_rows(split, 1)

    async def main():
        async with RolloutClient([agent_server.url], health_interval=0) as client:
            return await run_agent_loops(
                rows,
                client,
                tiny_qwen2_tokenizer,
                loop_kwargs={
                    "env": {
                        "max_turns": 2,
                        "max_response_length": 96,
                        # Many stop ids: the random model's turns end (not cut) quickly.
                        "sampling_params": {
                            "max_new_tokens": 8,
                            "stop_token_ids": list(range(20, 1024, 3)),
                        },
                        "env_kwargs": {**FAST, "max_steps": 5},
                    }
                },
            )

    (traj,) = asyncio.run(main())
    assert traj.num_turns == 2 and len(traj.turn_rewards) == 2, traj.finish_reason
    assert traj.turn_rewards[0] == 0.0 and 0.0 < traj.turn_rewards[1] < 1.0
    assert traj.reward == traj.turn_rewards[1] and traj.metrics["env/solved"] == 0.0


def test_time_memory_and_disk_limits_hold():
    async def main():
        env = SWEEnv(timeout=4.0, memory_mb=256, disk_mb=8, max_steps=9)
        env.reset(index=0)
        slow = await env.call("bash", {"command": "sleep 30; echo woke"})
        big = await env.call(
            "bash", {"command": "python3 -c \"open('big', 'wb').write(bytes(64 << 20))\""}
        )
        hungry = await env.call(
            "bash", {"command": 'python3 -c "x = bytearray(1 << 30); print(len(x))"'}
        )
        return slow[0], big[0], hungry[0], env.files

    slow, big, hungry, files = asyncio.run(main())
    assert "timed out" in slow and "woke" not in slow
    assert "No space left" in big or "File too large" in big, big
    assert "MemoryError" in hungry, hungry
    assert "big" not in files  # nothing over the limit reached the episode's copy


def test_the_swe_agent_runs_through_the_openai_proxy_path(agent_server, tiny_qwen2_tokenizer):
    """The random model calls no tool: one call, then the tests score the buggy code."""
    from polyrl.agent import run_agent_loops
    from polyrl.rollout.client import RolloutClient

    (row,) = swe_rows("heldout", 1)
    # Without agent_name (which picks the env loop), the default openai_agent loop plays it.
    extra = {k: v for k, v in row["extra_info"].items() if k != "agent_name"}
    row = {**row, "extra_info": extra}

    async def main():
        async with RolloutClient([agent_server.url], health_interval=0) as client:
            return await run_agent_loops(
                [{**row, "seed": 3}],
                client,
                tiny_qwen2_tokenizer,
                default_agent="openai_agent",
                loop_kwargs={
                    "openai_agent": {
                        "entrypoint": "polyrl.agent.swe_env:openai_swe_agent",
                        "max_response_length": 64,
                        "sampling_params": {"max_new_tokens": 8},
                    }
                },
            )

    (traj,) = asyncio.run(main())
    assert traj.agent_name == "openai_agent" and traj.metrics["agent/failed"] == 0.0, traj
    assert traj.num_turns >= 1 and 0.0 < traj.reward < 1.0
    assert traj.metrics["agent_info/solved"] == 0.0


def test_a_scripted_fix_through_the_openai_proxy_path_scores_one(
    agent_server, tiny_qwen2_tokenizer
):
    """The model's turns are scripted (each sent to the real server first): a write_file
    call with the fix, then submit; the proxy turns them into OpenAI tool calls, the agent
    echoes them back, and the episode is one trajectory with reward 1.0."""
    from polyrl.agent import run_agent_loops
    from polyrl.rollout.client import RolloutClient

    tok = tiny_qwen2_tokenizer
    task = make_repo("train", 4)
    ((path, fixed),) = task.fix.items()
    script = [
        call("write_file", path=path, content=fixed),
        call("submit"),
    ]

    class Scripted:
        def __init__(self, client):
            self.client = client

        async def generate(self, input_ids, sampling_params=None, *, session_id=None, **kw):
            params = {**dict(sampling_params or {}), "max_new_tokens": 1}
            result = await self.client.generate(input_ids, params, session_id=session_id)
            ids = tok.encode(script.pop(0), add_special_tokens=False) + [tok.eos_token_id]
            out = result.outputs[0]
            out.output_ids, out.logprobs, out.finish_reason = ids, [-0.5] * len(ids), "stop"
            return result

    row = {
        "prompt": [{"role": "user", "content": "fix it"}],
        "extra_info": {"env_kwargs": {"split": "train", "index": 4, **FAST}},
    }

    async def main():
        async with RolloutClient([agent_server.url], health_interval=0) as client:
            return await run_agent_loops(
                [row],
                Scripted(client),
                tok,
                default_agent="openai_agent",
                loop_kwargs={
                    "openai_agent": {
                        "entrypoint": "polyrl.agent.swe_env:openai_swe_agent",
                        "max_response_length": 2048,
                    }
                },
            )

    (traj,) = asyncio.run(main())
    assert traj.metrics["agent/failed"] == 0.0, traj.finish_reason
    assert traj.num_turns == 2 and traj.reward == 1.0
    assert traj.metrics["agent_info/solved"] == 1.0
    assert 0 in traj.response_mask  # the tool message's tokens, not trained on
