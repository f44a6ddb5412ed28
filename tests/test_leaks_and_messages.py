"""Nothing left behind, and errors that say what is wrong (issue 23, item 6).

Replica temporary directories, the agent proxy's record of failed calls, and the messages for
bad data, corrupt checkpoints, malformed weight-transfer requests and user errors on the CLI.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from polyrl.agent.proxy import RecordingProxy
from polyrl.core.rollout_api import EngineUnavailableError
from polyrl.rollout.launcher import ServerProcess

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ replicas
def test_a_replica_removes_its_temporary_directory_and_keeps_its_log_tail(tiny_qwen2_dir):
    proc = ServerProcess(tiny_qwen2_dir, options={"num_threads": 1}).start(timeout=180)
    tmp = Path(proc._tmp)
    assert tmp.name.startswith("polyrl-replica-") and (tmp / "server.log").is_file()
    assert proc.stop() == 0
    assert not tmp.exists()
    assert proc.log_tail()  # still readable, from memory


def test_a_killed_or_never_started_replica_leaves_no_directory(tmp_path):
    crashed = ServerProcess("/nonexistent", module="polyrl.no_such_module").spawn()
    deadline = time.monotonic() + 60
    while crashed.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    tmp = Path(crashed._tmp)
    assert tmp.is_dir()
    crashed.kill()
    assert not tmp.exists()
    assert "No module named" in crashed.log_tail()

    unused = ServerProcess("/nonexistent")
    assert unused.stop() is None and not Path(unused._tmp).exists()


def test_a_replica_keeps_a_log_the_caller_placed(tmp_path):
    log = tmp_path / "replica.log"
    proc = ServerProcess("/nonexistent", module="polyrl.no_such_module", log_path=log).spawn()
    proc.process.wait(timeout=60)
    proc.stop()
    assert not Path(proc._tmp).exists()
    assert "No module named" in log.read_text()


# ------------------------------------------------------------------------------ agent proxy
class _FlakyClient:
    """A rollout client whose calls fail while ``down`` is set."""

    def __init__(self, eos_id: int):
        self.down = False
        self.eos_id = eos_id
        self.calls = 0

    async def generate(self, ids, params, session_id=None):
        self.calls += 1
        if self.down:
            raise EngineUnavailableError("replica at http://127.0.0.1:1 is down")
        output = SimpleNamespace(
            output_ids=[11, 12, self.eos_id],
            logprobs=[-0.1, -0.2, -0.3],
            finish_reason="stop",
            weight_version=3,
        )
        return SimpleNamespace(outputs=[output], weight_version=3)


def test_a_failed_upstream_call_records_nothing(tiny_qwen2_tokenizer):
    tok = tiny_qwen2_tokenizer
    client = _FlakyClient(tok.eos_token_id)
    proxy = RecordingProxy(client, tok)
    first = [{"role": "user", "content": "2+2?"}]

    async def chat(messages, sid="s1"):
        return await proxy.chat({"messages": messages}, sid)

    # A new session whose only call fails does not exist afterwards.
    client.down = True
    with pytest.raises(EngineUnavailableError):
        asyncio.run(chat(first))
    assert "s1" not in proxy.sessions
    with pytest.raises(KeyError):
        proxy.trajectory("s1")

    client.down = False
    answer, _ = asyncio.run(chat(first))
    before = proxy.trajectory("s1")
    assert before["num_segments"] == 1 and before["num_turns"] == 1

    follow_up = [*first, answer["choices"][0]["message"], {"role": "user", "content": "and 3+3?"}]
    rewritten = [{"role": "user", "content": "something else"}]
    client.down = True
    for messages in (follow_up, rewritten):  # an extension, then a new segment: both fail
        with pytest.raises(EngineUnavailableError):
            asyncio.run(chat(messages))
    assert proxy.trajectory("s1") == before  # no phantom segment, no half-recorded turn

    client.down = False
    asyncio.run(chat(follow_up))
    after = proxy.trajectory("s1")
    assert after["num_segments"] == 1 and after["num_turns"] == 2
    assert client.calls == 5


# ------------------------------------------------------------------------------ checkpoints
def test_a_truncated_checkpoint_file_is_named_as_corrupt(tiny_qwen2_dir, tmp_path, engines):
    from polyrl.model_engine.checkpoint import CorruptCheckpointError

    root = tmp_path / "ckpt"
    engines(str(tiny_qwen2_dir)).save_checkpoint(str(root), 1)
    step = root / "global_step_1"
    rng = step / "rng" / "rank_0.pt"
    rng.write_bytes(rng.read_bytes()[:40])
    with pytest.raises(CorruptCheckpointError) as info:
        engines(str(tiny_qwen2_dir)).load_checkpoint(str(root))
    message = str(info.value)
    assert f"checkpoint {str(step)!r} is corrupt" in message
    assert "'rng/rank_0.pt' (the RNG state)" in message

    rng.write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match="rng/rank_0.pt"):
        engines(str(tiny_qwen2_dir)).load_checkpoint(str(root))
    state = step / "engine_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match="'engine_state.pt' \\(the engine state\\)"):
        engines(str(tiny_qwen2_dir)).load_checkpoint(str(root))
