"""Each router of the rollout server alone, in-process, over a real native backend.

A router is mounted on a bare FastAPI app (plus the error handlers where a test reads an error
body) and driven through httpx's ASGI transport: no server process, no other routes.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from polyrl.rollout.base import create_backend
from polyrl.rollout.routes.admin import admin_router
from polyrl.rollout.routes.common import RequestTable, add_error_handlers
from polyrl.rollout.routes.generation import generation_router
from polyrl.rollout.routes.openai import openai_router
from polyrl.rollout.server import create_app
from polyrl.workers.rollout_server import create_replica_app

OPTIONS = {
    "num_threads": 1,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "kv_cache_tokens": 2048,
    "max_model_len": 512,
}
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: the backend delivers its tokens to the loop it started on."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def backend(tiny_qwen2_dir, loop):
    backend = create_backend("native", tiny_qwen2_dir, **OPTIONS)
    loop.run_until_complete(backend.start())
    yield backend
    loop.run_until_complete(backend.shutdown())


def request(loop, app, method, path, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            return await client.request(method, path, **kwargs)

    return loop.run_until_complete(go())


def test_admin_router_alone_answers_health(loop, backend):
    app = FastAPI()
    app.include_router(admin_router(backend))
    r = request(loop, app, "GET", "/health")
    assert r.status_code == 200
    health = r.json()
    assert health["status"] == "ok" and health["backend"] == "native"
    assert health["weight_version"] == backend.weight_version
    assert request(loop, app, "POST", "/generate", json={"input_ids": [5]}).status_code == 404


def test_generation_router_alone_generates_and_forgets_the_request(loop, backend):
    app = FastAPI()
    add_error_handlers(app)
    table = RequestTable(backend)
    app.include_router(generation_router(backend, table))
    body = {"input_ids": [[17, 42, 99], [23, 5]], "sampling_params": GREEDY, "request_id": "b"}
    r = request(loop, app, "POST", "/generate", json=body)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [res["request_id"] for res in results] == ["b-0", "b-1"]
    assert all(len(res["outputs"][0]["output_ids"]) == 4 for res in results)
    assert table.inflight == {}
    r = request(loop, app, "POST", "/generate", json={"input_ids": [17], "temperature": 0})
    assert r.status_code == 400
    assert "go inside 'sampling_params'" in r.json()["error"]["message"]


def test_openai_router_alone_completes_text(loop, backend, tiny_qwen2_tokenizer):
    app = FastAPI()
    table = RequestTable(backend)
    app.include_router(openai_router(backend, tiny_qwen2_tokenizer, table))
    body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
    r = request(loop, app, "POST", "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["object"] == "text_completion"
    assert answer["usage"]["completion_tokens"] == 3
    assert isinstance(answer["choices"][0]["text"], str)
    assert table.inflight == {}


def test_create_app_applies_extensions_after_the_rollout_routes(loop, backend):
    seen = []

    def extension(app: FastAPI, b) -> None:
        seen.append(b)

        @app.get("/extra")
        async def extra() -> dict:
            return {"paths": sorted({getattr(r, "path", "") for r in app.routes})}

    app = create_app(backend, None, manage_backend=False, extensions=[extension])
    assert seen == [backend]
    paths = request(loop, app, "GET", "/extra").json()["paths"]
    assert {"/generate", "/health", "/v1/completions"} <= set(paths)
    assert request(loop, app, "GET", "/weights/status").status_code == 404


def test_replica_app_has_the_weight_routes(loop, backend):
    app = create_replica_app(backend, None, api_key="k", manage_backend=False)
    auth = {"Authorization": "Bearer k"}
    r = request(loop, app, "GET", "/weights/status", headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["transfer_id"] is None
    assert request(loop, app, "GET", "/weights/status").status_code == 401
