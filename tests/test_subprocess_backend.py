"""The subprocess-backend base and the core's process helpers, with real child processes.

vLLM and SGLang cannot run here, so :class:`~polyrl.rollout.vllm_backend.VLLMBackend` is
pointed at a fake "vLLM venv": its ``bin/python`` is the test interpreter and its
``site-packages`` hold a stand-in for vLLM's server module, a stdlib HTTP server that speaks
the few endpoints the backend uses. What runs for real is everything the base owns: the
launch through the parent-death stub in a process group of its own, the retry on a port
clash, ``/health`` polling, the warm-up, streaming through :class:`StreamJob`, the mapping
of HTTP failures onto rollout errors, the metrics poller, the counters, and stopping the whole
process group. The SGLang side of the same base is covered over HTTP by
``tests/test_rollout_sglang.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polyrl.core.process import free_port, kill_group
from polyrl.core.rollout_api import (
    EngineUnavailableError,
    GenerateRequest,
    InvalidRequestError,
    RolloutError,
    SamplingParams,
    collect_outputs,
)
from polyrl.rollout.vllm_backend import VLLMBackend

# The stand-in for ``python -m vllm.entrypoints.launchers.api_server.entry``. Each sample's
# token k is ``last prompt token + k + 1``, with log-prob ``-(k + 1) / 10``.
FAKE_SERVER = r"""
import json, os, subprocess, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
name = args[args.index("--served-model-name") + 1]
marker = os.environ.get("FAKE_CLASH_MARKER")
if marker and not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit("OSError: [Errno 98] Address already in use")
# A worker in the server's process group, as vLLM's engine core is.
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.environ["FAKE_WORKER_PID"], "w") as f:
    f.write(str(worker.pid))
METRICS = (
    'vllm:num_requests_waiting{model_name="m"} 0\n'
    'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
    'vllm:cache_config_info{block_size="16",kv_cache_size_tokens="256",'
    'kv_cache_memory_bytes="1024"} 1\n'
)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def answer(self, status, body, kind="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.answer(200, "", "text/plain")
        elif self.path == "/v1/models":
            self.answer(200, {"data": [{"id": name, "max_model_len": 64}]})
        elif self.path == "/metrics":
            self.answer(200, METRICS, "text/plain")
        else:
            self.answer(404, {"detail": "Not Found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
        if self.path == "/boom":
            self.answer(500, {"error": {"message": "kaput"}})
            return
        if self.path != "/v1/completions":
            self.answer(404, {"detail": "Not Found"})
            return
        prompt = body["prompt"]
        if prompt[0] == 99:
            self.answer(400, {"error": {"message": "no 99s here"}})
            return
        steps = range(body["max_tokens"])
        if not body.get("stream"):
            ids = [prompt[-1] + k + 1 for k in steps]
            choice = {"index": 0, "token_ids": ids, "finish_reason": "length"}
            self.answer(200, {"choices": [choice]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
        for k in steps:
            last = k == len(steps) - 1
            choices = [
                {
                    "index": i,
                    "token_ids": [prompt[-1] + k + 1],
                    "logprobs": {"token_logprobs": [-(k + 1) / 10]},
                    "finish_reason": "length" if last else None,
                }
                for i in range(body["n"])
            ]
            self.wfile.write(f"data: {json.dumps({'choices': choices})}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    config = {
        "vocab_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_size": 64,  # head size 32: one vLLM's CPU attention takes
        "max_position_embeddings": 256,
        "eos_token_id": 2,
    }
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture
def fake_venv(tmp_path: Path) -> Path:
    """A venv whose python is ours, with the fake server where vLLM's entry module lies."""
    venv = tmp_path / "venv-vllm"
    site = venv / "lib" / "python3.11" / "site-packages"
    entry = site / "vllm" / "entrypoints" / "launchers" / "api_server" / "entry.py"
    entry.parent.mkdir(parents=True)
    entry.write_text(FAKE_SERVER)
    (venv / "bin").mkdir()
    python = venv / "bin" / "python"
    # The backend sets PYTHONPATH to its extension's folder; the fake vLLM is added after it.
    python.write_text(
        f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site}" exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    return venv


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _backend(model_dir: Path, venv: Path, tmp_path: Path, **options) -> VLLMBackend:
    env = {"FAKE_WORKER_PID": str(tmp_path / "worker.pid"), **options.pop("env", {})}
    return VLLMBackend(
        model_dir,
        vllm_venv=str(venv),
        env=env,
        startup_timeout=60.0,
        metrics_interval=0.1,
        **options,
    )


def test_launch_stream_count_and_stop_the_whole_group(model_dir, fake_venv, tmp_path):
    backend = _backend(model_dir, fake_venv, tmp_path)
    seen: dict[str, str | None] = {}

    async def scenario() -> None:
        await backend.start()
        seen["tmp"] = backend._tmp
        try:
            assert backend.process is not None and backend.url is not None
            assert backend.info.model == "m" and backend.info.max_model_len == 64
            assert backend.warmup_seconds is not None
            assert os.getpgid(backend.process.pid) == backend.process.pid  # its own group
            request = GenerateRequest(
                "r1", (5, 6, 7), SamplingParams(max_new_tokens=3, n=2, logprobs=True)
            )
            out = await collect_outputs(request, await backend.generate(request, stream=False))
            for sample in out.outputs:
                assert sample.output_ids == [8, 9, 10]
                assert sample.logprobs == pytest.approx([-0.1, -0.2, -0.3])
                assert sample.finish_reason == "length"
            await asyncio.sleep(0.3)  # a scrape by the poller
            stats = backend.stats()
            assert (stats.prompt_tokens_total, stats.generated_tokens_total) == (3, 6)
            assert stats.finished_total == {"length": 2} and stats.ttft_count == 1
            assert (stats.kv_cache_blocks_total, stats.kv_cache_blocks_used) == (16, 8)
            assert stats.kv_cache_bytes == 1024 and stats.running == stats.waiting == 0
            # Token ids over HTTP carry no images: refused, not generated from placeholders.
            from polyrl.core.multimodal import MultiModalInputs

            media = MultiModalInputs({}, ("image",), ("digest",), (1,))
            with pytest.raises(InvalidRequestError, match="no images"):
                await backend.generate(GenerateRequest("img", (5, 6, 7), multi_modal=media))
        finally:
            await backend.shutdown()

    asyncio.run(scenario())
    worker = int((tmp_path / "worker.pid").read_text())
    assert _wait_gone(worker), "the server's worker outlived shutdown"
    assert backend.process is not None and backend.process.poll() is not None
    assert seen["tmp"] is not None and not Path(seen["tmp"]).exists()  # all went well: removed
    with pytest.raises(EngineUnavailableError, match="shutting down"):
        backend._check_serving()


def test_port_clash_errors_and_a_dead_server(model_dir, fake_venv, tmp_path):
    marker = tmp_path / "clashed"
    backend = _backend(
        model_dir, fake_venv, tmp_path, warmup=False, env={"FAKE_CLASH_MARKER": str(marker)}
    )

    async def scenario() -> None:
        await backend.start()
        try:
            assert marker.exists()  # the first launch lost its port; the second one serves
            assert backend.log_tail().count("# polyrl: ") == 2
            bad = GenerateRequest("r2", (99,), SamplingParams(max_new_tokens=2))
            with pytest.raises(InvalidRequestError, match="vLLM rejected the request: no 99s"):
                await collect_outputs(bad, await backend.generate(bad))
            with pytest.raises(RolloutError, match=r"vLLM server error \(HTTP 500\): kaput"):
                await backend._call("POST", "/boom")
            kill_group(backend.process.pid, signal.SIGKILL)
            await asyncio.to_thread(backend.process.wait)
            request = GenerateRequest("r3", (5,), SamplingParams(max_new_tokens=2))
            with pytest.raises(EngineUnavailableError, match="exited with code -9"):
                await backend.generate(request)
        finally:
            await backend.shutdown()

    asyncio.run(scenario())
    log = backend._log_path
    assert log is not None and log.is_file()  # kept after a failure, for a post-mortem
    assert not (log.parent / "polyrl_vllm_ext.py").exists()
    shutil.rmtree(log.parent)


# ------------------------------------------------------------------------ core helpers


def test_free_port_is_bindable_and_kill_group_tolerates_a_missing_group():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    kill_group(2**22 + 12345, signal.SIGTERM)  # beyond any pid: no such group, no error


def test_spawned_server_dies_with_its_parent(tmp_path):
    """A process that spawned a server is SIGKILLed: the kernel ends the server too."""
    log = tmp_path / "child.log"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from polyrl.core.process import spawn_group\n"
            "p = spawn_group([sys.executable, '-c', 'import time; time.sleep(600)'],"
            f" python=sys.executable, log_path={str(log)!r}, env={{}})\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert parent.stdout is not None
        server = int(parent.stdout.readline())
        assert _alive(server) and os.getpgid(server) == server
        assert "# polyrl: " in log.read_text()
        parent.kill()
        parent.wait()
        assert _wait_gone(server), "the server outlived the process that started it"
    finally:
        parent.kill()
        parent.wait()
