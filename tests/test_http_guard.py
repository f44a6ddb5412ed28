"""The request guards every polyrl HTTP service shares: JSON parsing, body size, exposure."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.core.http_guard import (
    BodyLimit,
    bearer_token,
    exposure_problem,
    is_loopback,
    json_depth,
    key_matches,
    parse_json,
)
from polyrl.core.rollout_api import InvalidRequestError


def deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


def test_depth_is_capped_before_parsing():
    with pytest.raises(InvalidRequestError, match="nests deeper than 64") as info:
        parse_json(deep(100_000))
    assert info.value.code == "json_too_deep"
    assert parse_json(deep(64)) is not None
    with pytest.raises(InvalidRequestError):
        parse_json(deep(65))
    # Brackets inside strings do not count; escaped quotes do not end a string.
    assert parse_json(json.dumps({"s": "[" * 1000 + '\\"' + "{" * 1000}).encode())
    assert json_depth(b'{"a": [1, {"b": [[]]}], "c": "]]]]"}') == 5


def test_huge_numbers_and_constants_are_a_400_not_a_500():
    for raw in (b"[" + b"9" * 5000 + b"]", b"[NaN]", b"[Infinity]", b"[1e999]", b"\xff\xfe"):
        with pytest.raises(InvalidRequestError) as info:
            parse_json(raw)
        assert info.value.status == 400 and info.value.code == "malformed_json"
    assert "4300" in str(pytest.raises(InvalidRequestError, parse_json, b"9" * 5000).value)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.integers() | st.text(), lambda c: st.lists(c, max_size=3)))
def test_depth_matches_the_structure(value):
    raw = json.dumps(value).encode()

    def depth(v):
        return 1 + max(map(depth, v), default=0) if isinstance(v, list) else 0

    assert json_depth(raw) == depth(value)
    assert parse_json(raw, max_depth=1000) == value


def _app(limit: int) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    app.add_middleware(BodyLimit, max_bytes=limit)
    return app


def _post(app, **kwargs) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/echo", **kwargs)

    return asyncio.run(go())


def test_body_limit_by_length_and_by_stream():
    app = _app(1000)
    assert _post(app, content=b"x" * 1000).json() == {"bytes": 1000}
    r = _post(app, content=b"x" * 1001)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    async def chunks():
        for _ in range(5):
            yield b"x" * 400

    r = _post(app, content=chunks())  # no Content-Length: counted as it arrives
    assert r.status_code == 413


def test_loopback_and_exposure_rules():
    for host in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org", "192.168.0.1"):
        assert not is_loopback(host), host
    assert exposure_problem("127.0.0.1", False, False, "set K") is None
    assert exposure_problem("0.0.0.0", True, False, "set K") is None
    assert exposure_problem("0.0.0.0", False, True, "set K") is None
    problem = exposure_problem("0.0.0.0", False, False, "set K")
    assert "without an API key" in problem and "--insecure" in problem and "set K" in problem


def test_bearer_token_and_key_match():
    assert bearer_token([(b"authorization", b"Bearer abc ")]) == b"abc"
    assert bearer_token([(b"authorization", b"Basic abc")]) is None
    assert bearer_token([]) is None
    assert key_matches(b"b", [b"a", b"b"]) == b"b"
    assert key_matches(b"c", [b"a", b"b"]) is None
    assert key_matches(None, [b"a"]) is None
