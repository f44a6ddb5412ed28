"""A real rollout server subprocess: token-in/out, OpenAI client, control, bad input, load."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import openai
import pytest
import torch
from waiting import wait_until

from polyrl.core.numerics import token_log_probs
from polyrl.models.loader import load_causal_lm, load_tokenizer
from polyrl.rollout.client import RolloutClient
from polyrl.rollout.launcher import ServerProcess

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPTIONS = {
    "num_threads": 1,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 256,
    "kv_cache_tokens": 16384,
    "max_model_len": 2048,
    "served_model_name": "tiny",
}


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir):
    return tiny_qwen2_dir


@pytest.fixture(scope="module")
def other_dir(tiny_qwen2_seed1_dir):
    return tiny_qwen2_seed1_dir


@pytest.fixture(scope="module")
def server(model_dir):
    proc = ServerProcess(model_dir, api_key=KEY, options=OPTIONS).start(timeout=180)
    yield proc
    assert proc.stop() == 0, proc.log_tail()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_causal_lm(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def greedy_ref(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


def gen(http, prompt, **params):
    r = http.post("/generate", json={"input_ids": prompt, "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json()


def test_health_and_auth(server, http):
    h = httpx.get(f"{server.url}/health").json()  # no token needed
    assert h["status"] == "ok" and h["model"] == "tiny" and h["max_model_len"] == 2048

    async def through_the_client():
        async with RolloutClient([server.url], api_key=KEY, health_interval=0) as c:
            return await c.health(server.url), await c.check_health()

    one, every = asyncio.run(through_the_client())
    assert one["weight_version"] == h["weight_version"]
    (state,) = every
    assert state["url"] == server.url and state["healthy"] and state["model"] == one["model"]
    r = httpx.post(f"{server.url}/generate", json={"input_ids": [1, 2]})
    assert r.status_code == 401 and "bearer" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_generate_token_in_token_out_with_logprobs(http, hf_model):
    prompt = [17, 42, 99, 311, 512]
    out = gen(http, prompt, max_new_tokens=12, temperature=0, logprobs=True, ignore_eos=True)
    sample = out["outputs"][0]
    assert sample["finish_reason"] == "length" and len(sample["output_ids"]) == 12
    assert len(sample["logprobs"]) == 12 and all(lp <= 0 for lp in sample["logprobs"])
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "cached_prompt_tokens": 0}
    assert "weight_version" in out and sample["weight_version"] == out["weight_version"]
    # Greedy output equals HF generate greedy on the same model.
    assert sample["output_ids"] == greedy_ref(hf_model, prompt, 12)
    # Batched prompts and n samples.
    batch = http.post(
        "/generate",
        json={"input_ids": [prompt, [5, 6, 7]], "sampling_params": {"max_new_tokens": 4, "n": 3}},
    ).json()
    assert len(batch["results"]) == 2 and all(len(r["outputs"]) == 3 for r in batch["results"])


def test_logprob_gap_over_http(http, hf_model):
    gaps = []
    for i, prompt in enumerate([[20, 30, 40], list(range(100, 160))]):
        out = gen(http, prompt, max_new_tokens=24, temperature=0.8, seed=i, logprobs=True)
        ids = out["outputs"][0]["output_ids"]
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        ref = token_log_probs(logits, torch.tensor(ids), temperature=0.8)
        gaps.append((ref - torch.tensor(out["outputs"][0]["logprobs"])).abs().max().item())
    print(f"server rollout/training log-prob gap (max abs): {max(gaps):.3e}")
    assert max(gaps) < 1e-4


def test_seed_determinism_under_concurrency(server):
    prompt = [11, 12, 13, 14]
    params = {"max_new_tokens": 16, "seed": 77, "ignore_eos": True}

    async def go():
        async with RolloutClient([server.url], api_key=KEY, health_interval=0) as c:
            alone = await c.generate(prompt, params)
            noise = [c.generate([i + 20, i + 21], {"max_new_tokens": 30}) for i in range(8)]
            crowd = await asyncio.gather(c.generate(prompt, params), *noise)
            return alone, crowd[0]

    alone, crowded = asyncio.run(go())
    assert alone.outputs[0].output_ids == crowded.outputs[0].output_ids


def test_openai_completions(server, tokenizer):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    out = client.completions.create(
        model="tiny", prompt="The answer is", max_tokens=10, temperature=0, logprobs=2
    )
    choice = out.choices[0]
    extra = choice.model_extra
    assert extra["prompt_token_ids"] == tokenizer("The answer is").input_ids
    assert len(extra["token_ids"]) == len(choice.logprobs.token_logprobs) <= 10
    assert all(len(t) <= 2 for t in choice.logprobs.top_logprobs)
    assert out.usage.completion_tokens == len(extra["token_ids"])
    streamed = client.completions.create(
        model="tiny", prompt="The answer is", max_tokens=10, temperature=0, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert ids == extra["token_ids"]
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    # Token-id prompts and n choices.
    many = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=3, n=2)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]


def test_openai_chat_with_tools(server, tokenizer):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    out = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=tools,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert (
        out.model_extra["prompt_token_ids"] == tokenizer(text, add_special_tokens=False).input_ids
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"])
    assert all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=tools,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text_out = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text_out == choice.message.content
    assert chunks[-1].usage.completion_tokens == len(choice.model_extra["token_ids"])
    seeded = [
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, n=2, seed=5, extra_body={"top_k": 20}
        )
        for _ in range(2)
    ]
    assert [c.message.content for c in seeded[0].choices] == [
        c.message.content for c in seeded[1].choices
    ]


def _stream_tokens(url, body, record, finished):
    with httpx.Client(headers=AUTH, timeout=60) as c:
        with c.stream("POST", f"{url}/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    record.extend(event["token_ids"])
                    if event["finish_reason"]:
                        finished["reason"] = event["finish_reason"]
    finished["done"] = True


def _generated_tokens(http) -> int:
    """The server's count of tokens generated so far (its /metrics counter)."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("polyrl_rollout_generated_tokens_total"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("no generated-tokens counter in /metrics")


def test_pause_abort_resume(server, http):
    before = _generated_tokens(http)
    tokens: list[int] = []
    finished: dict = {}
    body = {
        "input_ids": [3, 4, 5],
        "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
        "stream": True,
        "request_id": "long-one",
    }
    t = threading.Thread(target=_stream_tokens, args=(server.url, body, tokens, finished))
    t.start()
    deadline = time.time() + 30
    while len(tokens) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert http.post("/pause").json() == {"paused": True}
    # /pause answers once no step runs: the count is final; its tokens may be on the wire.
    frozen = _generated_tokens(http) - before
    wait_until(lambda: len(tokens) >= frozen, "the tokens made before the pause arrive")
    time.sleep(0.5)
    assert len(tokens) == frozen, "tokens kept coming while paused"
    assert _generated_tokens(http) - before == frozen
    assert http.get("/health").json()["paused"] is True

    # A request sent while paused waits for resume.
    waiting: dict = {}

    def later():
        waiting["out"] = gen(http, [7, 8], max_new_tokens=2)

    w = threading.Thread(target=later)
    w.start()
    wait_until(lambda: http.get("/health").json()["waiting"] == 1, "the request is queued")
    assert "out" not in waiting

    assert http.post("/abort", json={"request_ids": ["long-one"]}).json()["aborted"] == 1
    t.join(10)
    assert finished.get("reason") == "abort"
    assert len(tokens) == frozen and 3 <= frozen < 1500
    assert http.post("/resume").json() == {"paused": False}
    w.join(30)
    assert len(waiting["out"]["outputs"][0]["output_ids"]) <= 2


def test_update_weights_changes_outputs_and_version(http, model_dir, other_dir):
    prompt = [9, 8, 7, 6]
    before = gen(http, prompt, max_new_tokens=10, temperature=0, ignore_eos=True)
    v0 = before["weight_version"]
    r = http.post("/update_weights", json={"path": str(other_dir)})
    assert r.status_code == 200, r.text
    v1 = r.json()["weight_version"]
    assert v1 == v0 + 1
    after = gen(http, prompt, max_new_tokens=10, temperature=0, ignore_eos=True)
    assert after["weight_version"] == v1
    assert after["outputs"][0]["output_ids"] != before["outputs"][0]["output_ids"]
    assert after["outputs"][0]["output_ids"] == greedy_ref(load_causal_lm(other_dir), prompt, 10)
    assert "polyrl_rollout_weight_version" in http.get("/metrics").text
    r = http.post("/update_weights", json={"path": str(model_dir), "version": 100})
    assert r.json() == {"weight_version": 100}
    back = gen(http, prompt, max_new_tokens=10, temperature=0, ignore_eos=True)
    assert back["outputs"][0]["output_ids"] == before["outputs"][0]["output_ids"]
    assert back["weight_version"] == 100


def test_sleep_wake_up(http):
    r = http.post("/sleep", json={"level": 1}).json()
    assert r["kv_cache_bytes_released"] > 0
    metrics = http.get("/metrics").text
    assert 'polyrl_rollout_kv_cache_bytes{model="tiny",backend="native"} 0' in metrics
    r = http.post("/generate", json={"input_ids": [1, 2]})
    assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
    http.post("/wake_up", json={})
    assert gen(http, [1, 2], max_new_tokens=2)["outputs"][0]["finish_reason"] in ("stop", "length")


BAD_INPUTS = [
    ("/generate", b"{not json", "malformed JSON"),
    ("/generate", b"", "body is empty"),
    ("/generate", {"sampling_params": {}}, "missing required field 'input_ids'"),
    ("/generate", {"input_ids": "hello"}, "input_ids must be"),
    ("/generate", {"input_ids": [1, 2, 1_000_000]}, "unknown token id 1000000"),
    ("/generate", {"input_ids": [1, -5]}, "unknown token id -5"),
    ("/generate", {"input_ids": [1, 2.5]}, "expected an int id"),
    ("/generate", {"input_ids": [1] * 2048}, "context length"),
    (
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}},
        "exceeds the context length",
    ),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ("/generate", {"input_ids": [1], "sampling_params": {"n": 0}}, "invalid sampling parameter n"),
    ("/generate", {"input_ids": [1], "sampling_params": {"topk": 3}}, "did you mean 'top_k'"),
    ("/generate", {"input_ids": [1], "temperature": 0}, "go inside 'sampling_params'"),
    ("/v1/completions", {"model": "tiny"}, "missing required field 'prompt'"),
    ("/v1/completions", {"prompt": "hi", "temprature": 0}, "did you mean 'temperature'"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 1.0}, "not supported"),
    ("/v1/chat/completions", {"messages": []}, "messages must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "string 'role'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 1000}, "n"),
    ("/update_weights", {"path": "/definitely/not/here"}, "not a directory"),
    ("/sleep", {"level": 3}, "level must be 1 or 2"),
]


@pytest.mark.parametrize(("path", "body", "message"), BAD_INPUTS)
def test_bad_input_gets_a_clear_400(http, path, body, message):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert message in error["message"], error["message"]


def test_bad_input_leaks_nothing(http):
    assert http.get("/nope").status_code == 404
    assert http.get("/generate").status_code == 405
    h = http.get("/health").json()
    assert h["running"] == 0 and h["waiting"] == 0
    assert (
        'polyrl_rollout_kv_cache_blocks_used{model="tiny",backend="native"} 0'
        in http.get("/metrics").text
    )
    assert gen(http, [1, 2, 3], max_new_tokens=3)["outputs"][0]["finish_reason"]


def test_client_disconnect_frees_the_request(server, http):
    body = {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/generate", json=body, headers=AUTH, timeout=0.5)
    deadline = time.time() + 10
    while time.time() < deadline and http.get("/health").json()["running"]:
        time.sleep(0.1)
    assert http.get("/health").json()["running"] == 0
    assert 'finish_reason="abort"' in http.get("/metrics").text


def _main_thread_cpu_s(pid: int) -> float:
    # utime + stime of the process's main thread (its tid is the pid), in seconds.
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_waiting_requests_cost_the_event_loop_nothing(server, http):
    # The event loop shares the GIL with the engine thread, so whatever it does while
    # requests wait is taken from decoding. 128 non-streaming requests parked on a paused
    # engine must not keep it busy (polling each for a disconnect, through Starlette's
    # BaseHTTPMiddleware, cost ~0.3 s of CPU here over these 3 s).
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    pid = server.process.pid

    async def go() -> tuple[float, list[int]]:
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(
            base_url=server.url, headers=AUTH, timeout=60, limits=limits
        ) as c:
            assert (await c.post("/pause")).status_code == 200
            try:
                jobs = [asyncio.ensure_future(c.post("/generate", json=body)) for _ in range(128)]
                deadline = time.monotonic() + 30
                while http.get("/health").json()["waiting"] < 128:
                    assert time.monotonic() < deadline, "the 128 requests never all arrived"
                    await asyncio.sleep(0.1)
                before = _main_thread_cpu_s(pid)
                await asyncio.sleep(3.0)
                spent = _main_thread_cpu_s(pid) - before
            finally:
                await c.post("/resume")
            answers = await asyncio.gather(*jobs)
        return spent, [r.status_code for r in answers]

    spent, codes = asyncio.run(go())
    assert codes == [200] * 128
    assert spent < 0.1, f"the event loop used {spent:.2f} s of CPU while requests waited"


def test_256_concurrent_requests(server, http):
    async def go():
        async with RolloutClient([server.url], api_key=KEY, max_concurrency=256) as c:
            jobs = [
                c.generate([i % 900 + 16, 7, 8], {"max_new_tokens": 8 + i % 9, "ignore_eos": True})
                for i in range(256)
            ]
            return await asyncio.gather(*jobs)

    results = asyncio.run(go())
    assert len(results) == 256
    assert all(len(r.outputs[0].output_ids) == 8 + i % 9 for i, r in enumerate(results))
    metrics = http.get("/metrics").text
    assert "polyrl_rollout_generation_tokens_per_second" in metrics
    assert http.get("/health").json()["running"] == 0
