"""Malformed and oversized requests get a 4xx, never a 5xx (in-process, real native backend).

Every POST endpoint of the replica app (rollout routes and ``/weights/*``) and of the router
is sent bodies nested 100,000 deep, integers of 5,000 digits and wrong types; the limits of
:class:`~polyrl.rollout.options.ServerLimits` (body size, sequences, queued tokens, chat
templates) are each hit once.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from polyrl.rollout.base import create_backend
from polyrl.rollout.client import RolloutClient
from polyrl.rollout.options import ServerLimits
from polyrl.rollout.router import create_router_app
from polyrl.workers.rollout_server import create_replica_app

OPTIONS = {
    "num_threads": 1,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "kv_cache_tokens": 4096,
    "max_model_len": 512,
}
LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}
DEEP = b"[" * 100_000 + b"]" * 100_000
HUGE_INT = b'{"version": ' + b"9" * 5000 + b"}"
POSTS = [
    "/generate",
    "/abort",
    "/v1/completions",
    "/v1/chat/completions",
    "/sleep",
    "/wake_up",
    "/update_weights",
    "/weights/begin",
    "/weights/bucket",
    "/weights/commit",
    "/weights/abort",
    "/weights/dist/init",
]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def backend(tiny_qwen2_dir, loop):
    backend = create_backend("native", tiny_qwen2_dir, **OPTIONS)
    loop.run_until_complete(backend.start())
    yield backend
    loop.run_until_complete(backend.shutdown())


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "plain.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    return str(path)


@pytest.fixture(scope="module")
def limits(template_file):
    return ServerLimits(
        max_body_bytes=1 << 20,
        max_sequences=8,
        max_queued_tokens=64,
        chat_templates={"plain": template_file},
    )


@pytest.fixture(scope="module")
def app(backend, tiny_qwen2_tokenizer, limits):
    return create_replica_app(backend, tiny_qwen2_tokenizer, manage_backend=False, limits=limits)


def call(loop, app, *requests):
    """Send ``(method, path, kwargs)`` requests concurrently (each later one 0.3 s later)."""

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:

            async def one(i, method, path, kwargs):
                await asyncio.sleep(0.3 * i)
                return await client.request(method, path, **kwargs)

            return await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests)))

    return loop.run_until_complete(go())


def post(loop, app, path, **kwargs) -> httpx.Response:
    return call(loop, app, ("POST", path, kwargs))[0]


@pytest.mark.parametrize("path", POSTS)
def test_deep_and_huge_bodies_are_400_everywhere(loop, app, path):
    for raw in (DEEP, HUGE_INT, b'{"x": NaN}', b"[1, 2"):
        r = post(loop, app, path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, raw[:20], r.status_code, r.text[:300])
        assert "error" in r.json()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"input_ids": {"a": 1}}),
        ("/generate", {"input_ids": [1, 2], "sampling_params": []}),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop": [1]}}),
        ("/generate", {"input_ids": [1, 2], "request_id": 5}),
        ("/generate", {"input_ids": [[1], "x"]}),
        ("/generate", {"input_ids": [1], "sampling_params": {"seed": 10**30}}),
        ("/generate", {"input_ids": [10**30]}),
        ("/generate", [1, 2]),
        ("/abort", {"request_ids": "x"}),
        ("/abort", {"request_ids": [1]}),
        ("/v1/completions", {"prompt": {"a": 1}}),
        ("/v1/completions", {"prompt": "hi", "stop": 5}),
        ("/v1/completions", {"prompt": "hi", "best_of": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
        ("/v1/chat/completions", {"messages": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "stream_options": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "chat_template_kwargs": 1}),
        ("/sleep", {"level": "1"}),
        ("/wake_up", {"tags": [1]}),
        ("/update_weights", {"path": "/nowhere", "version": -1}),
        ("/update_weights", {"path": "/nowhere", "version": 1.5}),
        ("/update_weights", {"path": 3}),
        ("/weights/commit", {"transfer_id": "t", "version": {"a": 1}}),
        ("/weights/bucket", {"meta": 1, "source": []}),
        ("/weights/dist/init", {"host": "127.0.0.1", "port": "x", "rank": 0, "world_size": 2}),
    ],
)
def test_wrong_types_are_400(loop, app, path, body):
    r = post(loop, app, path, json=body)
    assert r.status_code == 400, (r.status_code, r.text[:300])


def test_weights_routes_read_odd_values_without_a_500(loop, app):
    # These routes convert what they read (str(), int()); odd values are not a server error.
    for path, body in (
        ("/weights/abort", {"transfer_id": {"a": [1]}, "reason": [2]}),
        ("/weights/begin", {"transfer_id": [1], "version": 10**40}),
        ("/weights/abort", {}),
    ):
        assert post(loop, app, path, json=body).status_code < 500, path


def test_version_minus_one_names_the_field(loop, app):
    r = post(loop, app, "/update_weights", json={"path": "/nowhere", "version": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "version"


def test_duplicate_in_flight_request_id_is_409(loop, app):
    first = {"input_ids": [5, 6], "sampling_params": LONG, "request_id": "dup"}
    # Paused, the first request stays in flight however fast the engine is.
    _, r1, r2, _, _ = call(
        loop,
        app,
        ("POST", "/pause", {}),
        ("POST", "/generate", {"json": first}),
        ("POST", "/generate", {"json": {"input_ids": [7], "request_id": "dup"}}),
        ("POST", "/abort", {"json": {"request_ids": ["dup"]}}),
        ("POST", "/resume", {}),
    )
    assert r2.status_code == 409, r2.text
    assert r2.json()["error"]["code"] == "duplicate_request_id"
    assert r1.status_code == 200 and r1.json()["outputs"][0]["finish_reason"] in ("abort", "length")


def test_sequences_and_queued_tokens_are_limited(loop, app):
    r = post(loop, app, "/generate", json={"input_ids": [[1, 2]] * 3, "sampling_params": {"n": 3}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences"
    r = post(loop, app, "/generate", json={"input_ids": list(range(1, 66))})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_tokens"
    holder = {"input_ids": list(range(1, 51)), "sampling_params": LONG, "request_id": "big"}
    _, r1, r2, _, _ = call(
        loop,
        app,
        ("POST", "/pause", {}),
        ("POST", "/generate", {"json": holder}),
        ("POST", "/v1/completions", {"json": {"prompt": list(range(1, 21)), "max_tokens": 1}}),
        ("POST", "/abort", {"json": {}}),
        ("POST", "/resume", {}),
    )
    assert r2.status_code == 429 and r2.headers["retry-after"] == "1", r2.text
    assert r2.json()["error"]["type"] == "rate_limit_error"
    assert r1.status_code == 200
    # Released: the budget is whole again.
    assert post(loop, app, "/v1/completions", json={"prompt": [1] * 20, "max_tokens": 1}).is_success


def test_body_over_the_limit_is_413(loop, app):
    r = post(loop, app, "/generate", json={"input_ids": [1] * 600_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_405_carries_allow(loop, app):
    r = call(loop, app, ("GET", "/generate", {}))[0]
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = call(loop, app, ("PUT", "/health", {}))[0]
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_chat_templates_come_from_the_model_or_the_allow_list(loop, app):
    msgs = [{"role": "user", "content": "hi"}]
    bomb = {"chat_template": "{{ 'ab ' * 33000000 }}"}
    body = {"messages": msgs, "chat_template_kwargs": bomb}
    r = post(loop, app, "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_not_allowed"
    assert "plain" in r.json()["error"]["message"]
    named = {"chat_template": "plain"}
    body = {"messages": msgs, "chat_template_kwargs": named, "max_tokens": 1}
    r = post(loop, app, "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    default = post(loop, app, "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    assert r.json()["prompt_token_ids"] != default.json()["prompt_token_ids"]
    body = {"messages": msgs, "chat_template_kwargs": {"tokenize": True}}
    assert post(loop, app, "/v1/chat/completions", json=body).status_code == 400


def test_bomb_template_when_allowed_is_refused_before_tokenizing(
    loop, backend, tiny_qwen2_tokenizer
):
    limits = ServerLimits(allow_request_chat_template=True)
    app = create_replica_app(backend, tiny_qwen2_tokenizer, manage_backend=False, limits=limits)
    bomb = {"chat_template": "{{ 'ab ' * 33000000 }}"}
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": bomb}
    r = post(loop, app, "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    text = {"prompt": "ab " * 2_000_000, "max_tokens": 1}  # 6 MB: over what fits 512 tokens
    r = post(loop, app, "/v1/completions", json=text)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_openapi_describes_every_post_body(loop, app):
    spec = call(loop, app, ("GET", "/openapi.json", {}))[0].json()
    posts = {p: ops["post"] for p, ops in spec["paths"].items() if "post" in ops}
    assert set(POSTS) <= set(posts)
    for path in set(POSTS):
        schema = posts[path]["requestBody"]["content"]["application/json"]["schema"]
        assert schema["type"] == "object" and schema["properties"], path
    generate = posts["/generate"]["requestBody"]["content"]["application/json"]["schema"]
    assert generate["required"] == ["input_ids"] and generate["additionalProperties"] is False
    assert "temperature" in str(generate["properties"]["sampling_params"])


def test_router_rejects_bad_bodies_itself():
    app = create_router_app(RolloutClient(["http://127.0.0.1:9"]), limits=ServerLimits())

    async def go(path, raw):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
            return await client.post(path, content=raw)

    for path in ("/generate", "/v1/chat/completions", "/abort", "/update_weights", "/sleep"):
        for raw in (DEEP, HUGE_INT, b"[1]" if path in ("/abort", "/sleep") else b"{"):
            r = asyncio.run(go(path, raw))
            assert r.status_code == 400, (path, raw[:10], r.text[:200])
    r = asyncio.run(go("/update_weights", b'{"path": "/x", "version": -1, "extra": 1}'))
    assert r.status_code == 400 and "extra" in r.text
    r = asyncio.run(go("/generate", b"x" * (9 << 20)))
    assert r.status_code == 413
