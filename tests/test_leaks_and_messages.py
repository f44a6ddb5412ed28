"""Nothing left behind, and errors that say what is wrong (issue 23, item 6).

Replica temporary directories, the agent proxy's record of failed calls, and the messages for
bad data, corrupt checkpoints, malformed weight-transfer requests and user errors on the CLI.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
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


# ------------------------------------------------------------------------------ /weights/*
@pytest.fixture(scope="module")
def weights_http():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from polyrl.weights.server_routes import register_weight_routes

    class Backend:
        weight_receive = "load_fn"
        weight_version = 0

        async def load_weights(self, pairs, version):
            return version

    app = FastAPI()
    assert register_weight_routes(app, Backend()) is not None
    with TestClient(app) as client:
        yield client


def _message(response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"]


def test_weight_requests_missing_a_field_name_it(weights_http):
    assert "missing field 'transfer_id'" in _message(weights_http.post("/weights/begin", json={}))
    assert "missing field 'meta'" in _message(weights_http.post("/weights/bucket", json={}))
    assert "missing field 'transfer_id'" in _message(weights_http.post("/weights/commit", json={}))
    assert "missing field 'host'" in _message(weights_http.post("/weights/dist/init", json={}))


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({"kind": "disk", "path": "/etc/passwd"}, "refusing disk path '/etc/passwd'"),
        ({"kind": "shm", "name": "/../etc/passwd"}, "refusing shared memory name '/../etc/passwd'"),
        ({"kind": "shm"}, "missing field 'source.name'"),
    ],
)
def test_a_bucket_from_a_foreign_path_is_refused_with_a_reason(weights_http, source, expected):
    weights_http.post("/weights/begin", json={"transfer_id": "t1", "version": 1})
    meta = {"transfer_id": "t1", "version": 1, "index": 0, "nbytes": 8, "tensors": []}
    message = _message(weights_http.post("/weights/bucket", json={"meta": meta, "source": source}))
    assert expected in message
    weights_http.post("/weights/abort", json={"transfer_id": "t1"})


def test_a_file_that_is_not_a_bucket_file_is_named(tmp_path):
    from polyrl.weights.base import WeightTransferError
    from polyrl.weights.transports import read_bucket_file

    fake = tmp_path / "t1-00000.safetensors"
    fake.write_text("root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(WeightTransferError, match="not a bucket file"):
        read_bucket_file(fake, lambda n: None)


# ------------------------------------------------------------------------------ data rows
def test_an_int_prompt_names_the_column_the_row_and_the_expected_type(tiny_qwen2_tokenizer):
    from polyrl.data import RLDataset, RowValidationError
    from polyrl.trainer.sft_data import SFTDataError, chats_from_rows

    rows = [{"data_source": "a", "prompt": 7, "reward_model": {"ground_truth": "1"}}]
    with pytest.raises(SFTDataError) as info:
        chats_from_rows(rows, source="train.jsonl")
    assert str(info.value) == (
        "train.jsonl: row 0: field 'prompt' must be a list of chat messages, got int"
    )
    with pytest.raises(SFTDataError, match="row 0: field 'messages' must be a list"):
        chats_from_rows([{"messages": 5}], source="train.jsonl")
    with pytest.raises(RowValidationError, match="row 0: field 'prompt' must be a list of chat"):
        RLDataset(rows, tiny_qwen2_tokenizer, max_prompt_length=64)


# ------------------------------------------------------------------------------ the CLI
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "polyrl.cli", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _one_line_exit_2(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("polyrl: error:")]
    return line


BAD_REWARDS = {
    "attribute": ("def compute_score(solution_str):\n    return 1.0\n", "nope", "no attribute"),
    "import": ("x = (\n", "compute_score", "importing reward function file"),
    "signature": (
        "def compute_score(foo, bar):\n    return 1.0\n",
        "compute_score",
        "requires parameter 'foo'",
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD_REWARDS))
def test_a_reward_function_that_cannot_be_used_is_one_line_and_exit_2(tmp_path, kind):
    source, name, expected = BAD_REWARDS[kind]
    path = tmp_path / "reward.py"
    path.write_text(source)
    proc = _cli(
        "train",
        "demo",
        f"trainer.output_dir={tmp_path / 'run'}",
        f"reward.custom_function={path}:{name}",
        "data.num_train=8",
        "data.num_val=0",
        "data.train_batch_size=8",
        "trainer.total_steps=1",
    )
    assert expected in _one_line_exit_2(proc)


def test_a_bad_data_row_is_one_line_and_exit_2(tmp_path):
    data = tmp_path / "train.jsonl"
    row = {"data_source": "arithmetic", "prompt": 3, "reward_model": {"ground_truth": "3"}}
    data.write_text("\n".join(json.dumps(row) for _ in range(8)) + "\n")
    proc = _cli(
        "train",
        "demo",
        f"trainer.output_dir={tmp_path / 'run'}",
        "data.task=",
        f"data.train_files=[{data}]",
        "trainer.total_steps=1",
    )
    line = _one_line_exit_2(proc)
    assert "row 0: field 'prompt' must be a list of chat messages, got int" in line
