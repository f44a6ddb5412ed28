"""The ``sglang`` rollout backend without SGLang: options, command line, JSON mapping, protocol.

SGLang's PyPI build needs a CUDA GPU (its kernels, ``sglang-kernel``, ship only CUDA code), so
no real SGLang server runs here. What is tested on the CPU:

* options validation and the exact server command line and environment;
* the request body (:func:`generate_body`) and response parsing (:func:`parse_generate_chunk`)
  as pure functions, against hand-written JSON in the shape SGLang's ``/generate`` answers;
* the whole :class:`SGLangBackend` over HTTP against :class:`FakeSGLangServer`, a stand-in.

The real server is exercised by ``tests_gpu/test_sglang_gpu.py`` where a GPU is available.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from polyrl.config.schema import ROLLOUT_BACKENDS
from polyrl.core.rollout_api import (
    EngineUnavailableError,
    GenerateRequest,
    InvalidRequestError,
    RolloutError,
    SamplingParams,
    collect_outputs,
)
from polyrl.rollout.base import available_backends, backend_options_class, create_backend
from polyrl.rollout.sglang_backend import (
    SGLANG_ARGS_ENV,
    SGLANG_VENV_ENV,
    SGLangBackend,
    SGLangOptions,
    default_sglang_venv,
    generate_body,
    parse_generate_chunk,
    parse_sglang_metrics,
    sglang_available,
)

VOCAB = 128
EOS = 2


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model directory with only what the backend reads: ``config.json``."""
    d = tmp_path / "tiny-model"
    d.mkdir()
    config = {
        "vocab_size": VOCAB,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_size": 64,
        "max_position_embeddings": 256,
        "eos_token_id": EOS,
    }
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture
def fake_venv(tmp_path: Path) -> Path:
    """A directory laid out like a venv with SGLang installed (the launcher file only)."""
    venv = tmp_path / "venv-sglang"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    pkg = venv / "lib" / "python3.11" / "site-packages" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "launch_server.py").write_text("")
    return venv


def _request(
    rid: str = "r1", prompt: tuple[int, ...] = (5, 6, 7), **params: Any
) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(**params))


# ------------------------------------------------------------------------------ options


def test_registered_lazily_and_configurable(model_dir: Path) -> None:
    assert "sglang" in available_backends()
    assert "sglang" in ROLLOUT_BACKENDS
    assert backend_options_class("sglang") is SGLangOptions
    backend = create_backend("sglang", str(model_dir), tensor_parallel_size=2)
    assert isinstance(backend, SGLangBackend)
    assert backend.options.tensor_parallel_size == 2


@pytest.mark.parametrize(
    ("option", "value", "needle"),
    [
        ("dtype", "fp8", "dtype='fp8'"),
        ("device", "gpu", "'cuda', 'cuda:<index>' or 'cpu'"),
        ("tensor_parallel_size", 0, "tensor_parallel_size=0: expected an int >= 1"),
        ("tensor_parallel_size", True, "tensor_parallel_size=True"),
        ("gpu_memory_utilization", 1.5, "a fraction in (0, 1)"),
        ("gpu_memory_utilization", 0, "a fraction in (0, 1)"),
        ("max_model_len", -4, "max_model_len=-4"),
        ("seed", -1, "seed=-1"),
        ("enable_sleep_mode", "yes", "true or false"),
        ("server_url", "localhost:30000", "http(s)://host:port"),
        ("startup_timeout", 0, "a number of seconds > 0"),
        ("extra_args", [1], "a list of command-line strings"),
        ("env", {"A": 1}, "a mapping of strings to strings"),
    ],
)
def test_bad_options_are_named(model_dir: Path, option: str, value: Any, needle: str) -> None:
    with pytest.raises(ValueError, match="invalid sglang backend option") as err:
        SGLangBackend(model_dir, **{option: value})
    assert needle in str(err.value)


def test_unknown_option_and_cpu_backup_without_sleep(model_dir: Path) -> None:
    with pytest.raises(TypeError, match=r"unknown sglang backend option\(s\) \['kv_blocks'\]"):
        SGLangBackend(model_dir, kv_blocks=4)
    with pytest.raises(ValueError, match="weights_cpu_backup=True needs enable_sleep_mode"):
        SGLangBackend(model_dir, weights_cpu_backup=True)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        SGLangBackend(model_dir.parent)


# ------------------------------------------------------------------- command and environment


def test_default_command_line(model_dir: Path, fake_venv: Path, monkeypatch) -> None:
    monkeypatch.delenv(SGLANG_ARGS_ENV, raising=False)
    backend = SGLangBackend(model_dir, sglang_venv=str(fake_venv))
    assert backend.command(31000) == [
        str(fake_venv / "bin" / "python"),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--skip-tokenizer-init",
        "--incremental-streaming-output",
        "--served-model-name",
        "tiny-model",
        "--dtype",
        "auto",
        "--tp-size",
        "1",
        "--device",
        "cuda",
        "--enable-metrics",
    ]


def test_command_line_maps_every_option(model_dir: Path, fake_venv: Path, monkeypatch) -> None:
    monkeypatch.setenv(SGLANG_ARGS_ENV, "--log-level debug")
    backend = SGLangBackend(
        model_dir,
        sglang_venv=str(fake_venv),
        dtype="bfloat16",
        device="cuda:2",
        tensor_parallel_size=2,
        max_model_len=4096,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        kv_cache_tokens=100000,
        gpu_memory_utilization=0.55,
        seed=7,
        served_model_name="policy",
        enable_prefix_caching=False,
        enable_sleep_mode=True,
        weights_cpu_backup=True,
        enforce_eager=True,
        deterministic_inference=True,
        enable_metrics=False,
        trust_remote_code=True,
        extra_args="--attention-backend triton",
    )
    cmd = backend.command(1234)
    joined = " ".join(cmd[3:])
    assert joined == (
        f"--model-path {model_dir} --host 127.0.0.1 --port 1234 --skip-tokenizer-init "
        "--incremental-streaming-output --served-model-name policy --dtype bfloat16 "
        "--tp-size 2 --device cuda --base-gpu-id 2 --context-length 4096 "
        "--max-running-requests 64 --chunked-prefill-size 8192 --max-total-tokens 100000 "
        "--mem-fraction-static 0.55 --random-seed 7 --disable-radix-cache "
        "--enable-memory-saver --enable-weights-cpu-backup --disable-cuda-graph "
        "--enable-deterministic-inference --trust-remote-code --attention-backend triton "
        "--log-level debug"
    )
    assert "--enable-metrics" not in cmd


def test_environment(model_dir: Path, fake_venv: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/polyrl/src")
    monkeypatch.setenv("VIRTUAL_ENV", "/polyrl/.venv")
    monkeypatch.setenv("POLYRL_API_KEY", "secret")
    backend = SGLangBackend(model_dir, sglang_venv=str(fake_venv), env={"NCCL_DEBUG": "INFO"})
    env = backend.environment()
    for key in ("PYTHONPATH", "VIRTUAL_ENV", "POLYRL_API_KEY"):
        assert key not in env
    assert env["PATH"].startswith(f"{fake_venv / 'bin'}:")
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1"


def test_missing_venv_is_a_clear_error(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    missing = tmp_path / "no-such-venv"
    monkeypatch.setenv(SGLANG_VENV_ENV, str(missing))
    assert default_sglang_venv() == missing
    assert not sglang_available()
    backend = SGLangBackend(model_dir)
    with pytest.raises(FileNotFoundError) as err:
        asyncio.run(backend.start())
    message = str(err.value)
    assert f"no SGLang installation in {missing}" in message
    assert "scripts/setup_sglang_venv.sh" in message
    assert SGLANG_VENV_ENV in message and "server_url" in message
    assert backend.process is None


def test_venv_detection(fake_venv: Path) -> None:
    assert sglang_available(fake_venv)
    (fake_venv / "lib" / "python3.11" / "site-packages" / "sglang" / "launch_server.py").unlink()
    assert not sglang_available(fake_venv)


# ----------------------------------------------------------------------- request mapping


def test_generate_body_greedy_defaults() -> None:
    body = generate_body(_request(max_new_tokens=4, temperature=0.0), 4, "rid-0")
    assert body == {
        "rid": "rid-0",
        "input_ids": [5, 6, 7],
        "sampling_params": {
            "max_new_tokens": 4,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "ignore_eos": False,
        },
        "stream": True,
    }


def test_generate_body_full() -> None:
    request = _request(
        max_new_tokens=8,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        stop_token_ids=(9, 11),
        ignore_eos=True,
        n=4,
        seed=2**63 - 1,
        logprobs=True,
        top_logprobs=3,
    )
    body = generate_body(request, 8, "rid-3", 3, stream_interval=16)
    assert body["sampling_params"] == {
        "max_new_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "stop_token_ids": [9, 11],
        "sampling_seed": 2,  # (seed + sample index) wraps at 2**63
        "stream_interval": 16,
    }
    assert body["return_logprob"] is True
    assert body["logprob_start_len"] == -1
    assert body["top_logprobs_num"] == 3
    assert "n" not in body["sampling_params"]  # one SGLang request per sample


def test_generate_body_refuses_stop_strings() -> None:
    with pytest.raises(InvalidRequestError, match="use stop_token_ids") as err:
        generate_body(_request(stop=("\n",)), 4, "rid")
    assert err.value.param == "stop"


# ---------------------------------------------------------------------- response parsing

# The shape of SGLang's /generate answer with --skip-tokenizer-init and return_logprob
# (docs: "Sampling Parameters" / "Native APIs"): output_ids plus meta_info with
# finish_reason {"type": "stop", "matched": id} | {"type": "length", "length": n} |
# {"type": "abort", "message": ...}, completion_tokens, cached_tokens and
# output_token_logprobs as [logprob, token_id, text-or-null] triples.
FINAL = {
    "output_ids": [17, 23, 2],
    "meta_info": {
        "id": "rid-0",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "cached_tokens": 2,
        "weight_version": "default",
        "output_token_logprobs": [[-0.5, 17, None], [-1.25, 23, None], [-0.125, 2, None]],
        "output_top_logprobs": [
            [[-0.5, 17, None], [-1.5, 4, None]],
            [[-0.75, 30, None], [-1.25, 23, None]],
            [[-0.125, 2, None], [-3.0, 9, None]],
        ],
    },
}


def test_parse_whole_answer() -> None:
    params = SamplingParams(logprobs=True, top_logprobs=1)
    delta, seen = parse_generate_chunk(FINAL, 0, params, index=1, weight_version=4)
    assert seen == 3
    assert delta.index == 1
    assert delta.token_ids == [17, 23, 2]
    assert delta.logprobs == [-0.5, -1.25, -0.125]
    assert delta.top_logprobs == [[(17, -0.5)], [(30, -0.75)], [(2, -0.125)]]
    assert delta.finish_reason == "stop"
    assert delta.stop_reason == 2
    assert delta.weight_version == 4
    assert delta.cached_prompt_tokens == 2


def test_parse_cumulative_and_incremental_streams_agree() -> None:
    params = SamplingParams(logprobs=True)
    lps = FINAL["meta_info"]["output_token_logprobs"]
    cumulative = [
        {
            "output_ids": FINAL["output_ids"][:k],
            "meta_info": {
                "finish_reason": None if k < 3 else {"type": "length", "length": 3},
                "completion_tokens": k,
                "output_token_logprobs": lps[:k],
            },
        }
        for k in (1, 3)
    ]
    incremental = [
        {
            "output_ids": FINAL["output_ids"][a:b],
            "meta_info": {
                "finish_reason": None if b < 3 else {"type": "length", "length": 3},
                "completion_tokens": b,
                "output_token_logprobs": lps[a:b],
            },
        }
        for a, b in ((0, 1), (1, 3))
    ]
    for chunks in (cumulative, incremental):
        seen, ids, logprobs = 0, [], []
        for chunk in chunks:
            delta, seen = parse_generate_chunk(chunk, seen, params)
            ids += delta.token_ids
            logprobs += delta.logprobs
        assert ids == [17, 23, 2]
        assert logprobs == [-0.5, -1.25, -0.125]
        assert delta.finish_reason == "length" and delta.stop_reason is None


def test_parse_abort_and_edge_cases() -> None:
    params = SamplingParams()
    aborted = {
        "output_ids": [],
        "meta_info": {
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "completion_tokens": 0,
        },
    }
    delta, seen = parse_generate_chunk(aborted, 0, params)
    assert (delta.token_ids, delta.finish_reason, seen, delta.logprobs) == ([], "abort", 0, None)
    # A stop string would name the matched text; an empty match falls back to the last token.
    stop = {"output_ids": [8], "meta_info": {"finish_reason": {"type": "stop"}}}
    delta, _ = parse_generate_chunk(stop, 0, params)
    assert (delta.finish_reason, delta.stop_reason) == ("stop", 8)
    # Missing log-probs become NaN rather than shifting the others onto the wrong tokens.
    short = {
        "output_ids": [8, 9],
        "meta_info": {"completion_tokens": 2, "output_token_logprobs": [[-0.25, 9, None]]},
    }
    delta, _ = parse_generate_chunk(short, 0, SamplingParams(logprobs=True))
    assert math.isnan(delta.logprobs[0]) and delta.logprobs[1] == -0.25
    with pytest.raises(RolloutError, match="reported 5 completion tokens but sent 1"):
        parse_generate_chunk({"output_ids": [1], "meta_info": {"completion_tokens": 5}}, 0, params)


def test_parse_metrics_sums_ranks() -> None:
    text = "\n".join(
        [
            "# HELP sglang:num_running_reqs The number of running requests.",
            "# TYPE sglang:num_running_reqs gauge",
            'sglang:num_running_reqs{model_name="m",tp_rank="0"} 3.0',
            'sglang:num_running_reqs{model_name="m",tp_rank="1"} 2.0',
            'sglang:num_queue_reqs{model_name="m"} 4.0',
            'sglang:max_total_num_tokens{model_name="m"} 1000.0',
            'sglang:num_used_tokens{model_name="m"} 250.0',
            'sglang:num_retracted_requests_total{model_name="m"} 6.0',
            'sglang:token_usage{model_name="m"} NaN',
            'sglang:gen_throughput{model_name="m"} 99.0',
        ]
    )
    assert parse_sglang_metrics(text) == {
        "running": 5.0,
        "waiting": 4.0,
        "total_tokens": 1000.0,
        "used_tokens": 250.0,
        "retractions": 6.0,
    }


# ---------------------------------------------------------------- protocol, stand-in server


class FakeSGLangServer:
    """A stand-in for an SGLang server, speaking the subset of its HTTP API polyrl uses.

    SGLang cannot run on a machine without a CUDA GPU (its PyPI kernels are CUDA-only), so the
    protocol of :class:`SGLangBackend` is tested against this tiny FastAPI app on 127.0.0.1.
    It answers ``/health``, ``/server_info``, ``/metrics``, ``/generate`` (streamed, in
    ``--incremental-streaming-output`` form or cumulative, one token per chunk: token
    ``k`` of a request is ``(last prompt id + k) % vocab`` with log-prob ``-k/10``),
    ``/abort_request``, ``/pause_generation``, ``/continue_generation``,
    ``/update_weights_from_disk``, ``/release_memory_occupation`` and
    ``/resume_memory_occupation`` in SGLang's request and response shapes, and records every
    control call in :attr:`calls`. It generates nothing real.
    """

    def __init__(self, incremental: bool = True, token_delay: float = 0.002):
        self.incremental = incremental
        self.token_delay = token_delay
        self.calls: list[tuple[str, Any]] = []
        self.bodies: list[dict[str, Any]] = []
        self.aborted: set[str] = set()
        self.paused = asyncio.Event()
        self.weight_version = "default"
        self.app = self._build()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> FakeSGLangServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake SGLang server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def control(self, path: str) -> list[Any]:
        """Bodies of the recorded calls to ``path``."""
        return [body for p, body in self.calls if p == path]

    def _build(self) -> FastAPI:
        app = FastAPI()
        fake = self

        @app.get("/health")
        async def health() -> PlainTextResponse:
            return PlainTextResponse("")

        @app.get("/server_info")
        async def server_info() -> dict[str, Any]:
            return {"context_length": 64, "version": "fake", "internal_states": [{}]}

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(
                'sglang:num_running_reqs{model_name="m"} 0.0\n'
                'sglang:max_total_num_tokens{model_name="m"} 512.0\n'
                'sglang:num_used_tokens{model_name="m"} 12.0\n'
            )

        for path in (
            "/abort_request",
            "/pause_generation",
            "/continue_generation",
            "/release_memory_occupation",
            "/resume_memory_occupation",
        ):

            async def handler(request: Request, path: str = path) -> JSONResponse:
                body = await request.json()
                fake.calls.append((path, body))
                if path == "/abort_request":
                    fake.aborted.add(body["rid"])
                elif path == "/pause_generation" and body.get("mode") == "in_place":
                    fake.paused.clear()
                elif path == "/continue_generation":
                    fake.paused.set()
                return JSONResponse(None if path.endswith("occupation") else {"status": "ok"})

            app.add_api_route(path, handler, methods=["POST"])

        @app.post("/update_weights_from_disk")
        async def update(request: Request) -> JSONResponse:
            body = await request.json()
            fake.calls.append(("/update_weights_from_disk", body))
            if not Path(body["model_path"]).is_dir():
                return JSONResponse(
                    {"success": False, "message": "no such dir", "num_paused_requests": 0},
                    status_code=400,
                )
            fake.weight_version = body.get("weight_version") or fake.weight_version
            return JSONResponse({"success": True, "message": "ok", "num_paused_requests": 0})

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            body = await request.json()
            fake.bodies.append(body)
            return StreamingResponse(fake._stream(body), media_type="text/event-stream")

        self.paused.set()
        return app

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        rid = body.get("rid", "warmup")
        sp = body["sampling_params"]
        stops = set(sp.get("stop_token_ids") or ())
        if not sp.get("ignore_eos"):
            stops.add(EOS)
        start = body["input_ids"][-1]
        ids: list[int] = []
        lps: list[list[Any]] = []
        finish: dict[str, Any] | None = None
        if not body.get("stream"):
            ids = [(start + k) % VOCAB for k in range(1, sp["max_new_tokens"] + 1)]
            meta = {"id": rid, "finish_reason": {"type": "length"}, "completion_tokens": len(ids)}
            yield json.dumps({"output_ids": ids, "meta_info": meta}).encode()
            return
        while finish is None:
            await self.paused.wait()
            await asyncio.sleep(self.token_delay)
            if rid in self.aborted:
                finish = {"type": "abort", "message": "Abort before prefill"}
                new: list[int] = []
            else:
                k = len(ids) + 1
                token = (start + k) % VOCAB
                new = [token]
                ids.append(token)
                lps.append([-k / 10, token, None])
                if token in stops:
                    finish = {"type": "stop", "matched": token}
                elif len(ids) >= sp["max_new_tokens"]:
                    finish = {"type": "length", "length": len(ids)}
            meta: dict[str, Any] = {
                "id": rid,
                "finish_reason": finish,
                "completion_tokens": len(ids),
                "cached_tokens": 1,
                "weight_version": self.weight_version,
            }
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = (
                    lps[len(lps) - len(new) :] if self.incremental else lps
                )
            out = {"output_ids": new if self.incremental else list(ids), "meta_info": meta}
            yield b"data: " + json.dumps(out).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"


@pytest.fixture
def fake_server() -> Iterator[FakeSGLangServer]:
    with FakeSGLangServer() as server:
        yield server


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_protocol_generate_against_fake_server(
    model_dir: Path, fake_server: FakeSGLangServer
) -> None:
    async def go() -> None:
        backend = SGLangBackend(model_dir, server_url=fake_server.url, metrics_interval=0.05)
        await backend.start()
        try:
            assert backend.info.max_model_len == 64  # /server_info's context_length
            assert backend.info.eos_token_ids == (EOS,)
            assert backend.info.backend == "sglang"
            assert backend.process is None  # nothing launched for server_url
            # Streamed, n=2, with log-probs; the fake counts up from the last prompt id.
            request = _request(
                "a", (5, 6, 7), max_new_tokens=4, n=2, logprobs=True, temperature=0.0
            )
            out = await collect_outputs(request, await backend.generate(request))
            for sample in out.outputs:
                assert sample.output_ids == [8, 9, 10, 11]
                assert sample.logprobs == [-0.1, -0.2, -0.3, -0.4]
                assert sample.finish_reason == "length"
                assert sample.cached_prompt_tokens == 1
            rids = [b["rid"] for b in fake_server.bodies if b.get("stream")]
            assert len(rids) == 2 and len(set(rids)) == 2
            assert all(r.startswith("polyrl-") and r.endswith("-a") for r in rids)
            # Not streamed: one delta per sample; eos (2) ends it with stop_reason = the token.
            request = _request("b", (125,), max_new_tokens=10)
            deltas = [d async for d in await backend.generate(request, stream=False)]
            assert len(deltas) == 1
            assert deltas[0].token_ids == [126, 127, 0, 1, 2]
            assert (deltas[0].finish_reason, deltas[0].stop_reason) == ("stop", EOS)
            assert fake_server.bodies[-1]["sampling_params"]["stream_interval"] == 16
            with pytest.raises(InvalidRequestError, match="context length"):
                await backend.generate(_request("c", (1,) * 60, max_new_tokens=10))
            with pytest.raises(InvalidRequestError, match="stop_token_ids"):
                await backend.generate(_request("d", stop=("x",)))
            await asyncio.sleep(0.1)
            stats = backend.stats()
            assert stats.generated_tokens_total == 13
            assert stats.finished_total == {"length": 2, "stop": 1}
            assert (stats.kv_cache_blocks_total, stats.kv_cache_blocks_used) == (512, 12)
        finally:
            await backend.shutdown()

    _run(go())


def test_protocol_abort_keeps_partial_tokens(model_dir: Path) -> None:
    async def go(server: FakeSGLangServer) -> None:
        backend = SGLangBackend(model_dir, server_url=server.url, warmup=False)
        await backend.start()
        try:
            request = _request("long", (3,), max_new_tokens=60, ignore_eos=True, logprobs=True)
            stream = await backend.generate(request)
            got = []
            async for delta in stream:
                got.append(delta)
                if len(got) == 3:
                    assert await backend.abort(["long"]) == 1
            assert got[-1].finish_reason == "abort"
            tokens = [t for d in got for t in d.token_ids]
            assert 3 <= len(tokens) < 60
            assert tokens == [4 + k for k in range(len(tokens))]
            rid = server.bodies[-1]["rid"]
            assert server.control("/abort_request") == [{"rid": rid}]
            assert backend.stats().finished_total == {"abort": 1}
        finally:
            await backend.shutdown()

    with FakeSGLangServer(token_delay=0.02) as server:
        _run(go(server))


def test_protocol_cumulative_stream(model_dir: Path) -> None:
    async def go(server: FakeSGLangServer) -> None:
        backend = SGLangBackend(model_dir, server_url=server.url, warmup=False)
        await backend.start()
        try:
            request = _request("cum", (20,), max_new_tokens=5, logprobs=True)
            out = await collect_outputs(request, await backend.generate(request))
            assert out.outputs[0].output_ids == [21, 22, 23, 24, 25]
            assert out.outputs[0].logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
        finally:
            await backend.shutdown()

    with FakeSGLangServer(incremental=False) as server:
        _run(go(server))


def test_protocol_control_endpoints(
    model_dir: Path, tmp_path: Path, fake_server: FakeSGLangServer
) -> None:
    weights = tmp_path / "staged"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"")

    async def go() -> None:
        backend = SGLangBackend(model_dir, server_url=fake_server.url, warmup=False)
        await backend.start()
        try:
            # pause: new requests wait here, in-flight ones are frozen in place by SGLang.
            await backend.pause()
            request = _request("p", (40,), max_new_tokens=3)
            stream = await backend.generate(request)
            reader = asyncio.ensure_future(collect_outputs(request, stream))
            await asyncio.sleep(0.1)
            assert not reader.done() and backend.stats().paused
            assert fake_server.bodies == []
            await backend.resume()
            out = await reader
            assert out.outputs[0].output_ids == [41, 42, 43]
            assert fake_server.control("/pause_generation") == [{"mode": "in_place"}]
            assert fake_server.control("/continue_generation") == [{}]
            # update_weights: retract, reload from the directory, continue; version bumped.
            assert await backend.update_weights(str(weights)) == 1
            assert await backend.update_weights(str(weights), version=7) == 7
            updates = fake_server.control("/update_weights_from_disk")
            assert updates[-1] == {
                "model_path": str(weights.resolve()),
                "weight_version": "7",
                "flush_cache": True,
            }
            assert fake_server.control("/pause_generation")[-1] == {"mode": "retract"}
            assert len(fake_server.control("/continue_generation")) == 3
            request = _request("v", (50,), max_new_tokens=2)
            out = await collect_outputs(request, await backend.generate(request))
            assert out.outputs[0].weight_version == 7
            assert out.outputs[0].first_weight_version == 7
            with pytest.raises(InvalidRequestError, match="safetensors"):
                await backend.update_weights(str(tmp_path / "missing"))
            # sleep(2) releases both and requires new weights; wake_up resumes what was released.
            answer = await backend.sleep(level=2)
            assert answer["released"] == ["kv_cache", "weights"]
            assert fake_server.control("/release_memory_occupation") == [
                {"tags": ["kv_cache", "weights"]}
            ]
            with pytest.raises(EngineUnavailableError, match="asleep"):
                await backend.generate(_request("s"))
            woke = await backend.wake_up()
            assert woke["resumed"] == ["weights", "kv_cache"] and woke["needs_weights"]
            with pytest.raises(EngineUnavailableError, match="discarded"):
                await backend.generate(_request("s"))
            assert await backend.update_weights(str(weights)) == 8
            await backend.sleep(level=1)
            assert fake_server.control("/release_memory_occupation")[-1] == {"tags": ["kv_cache"]}
            woke = await backend.wake_up(["kv_cache"])
            assert woke == {"needs_weights": False, "resumed": ["kv_cache"], "sglang": None}
            with pytest.raises(InvalidRequestError, match="unknown wake_up tag"):
                await backend.wake_up(["gpu"])
        finally:
            await backend.shutdown()

    _run(go())


def test_sleep_needs_memory_saver_when_launched(model_dir: Path) -> None:
    backend = SGLangBackend(model_dir)
    with pytest.raises(InvalidRequestError, match="enable_sleep_mode=true"):
        _run(backend.sleep())


def test_weight_routes_stage_a_directory_for_sglang(model_dir: Path) -> None:
    """The /weights/* routes stage transfers as a safetensors dir for update_weights(path)."""
    from polyrl.weights.server_routes import register_weight_routes
    from polyrl.weights.staging import SafetensorsDirTarget

    app = FastAPI()
    receiver = register_weight_routes(app, SGLangBackend(model_dir))
    assert receiver is not None
    assert isinstance(receiver.target, SafetensorsDirTarget)
