"""Who may reach what: non-loopback binding needs a key; the agent proxy's keys and sessions."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from polyrl import cli
from polyrl.agent.proxy import RecordingProxy, create_proxy_app
from polyrl.core.rollout_api import RequestOutput, SampleOutput
from polyrl.rollout.server import check_exposure

MSGS = [{"role": "user", "content": "hi"}]


def test_serve_refuses_an_open_non_loopback_address(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("POLYRL_API_KEY", raising=False)
    code = cli.main(["serve", str(tmp_path), "--host", "0.0.0.0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("polyrl: error: refusing to listen on 0.0.0.0 without an API key")
    assert "--insecure" in err and "POLYRL_API_KEY" in err
    code = cli.main(["serve", str(tmp_path), "--host", "0.0.0.0", "--replicas", "2"])
    assert code == 2 and "without an API key" in capsys.readouterr().err


def test_insecure_or_a_key_allows_it_and_insecure_warns(capsys):
    check_exposure("0.0.0.0", "k", insecure=False)
    check_exposure("127.0.0.1", None, insecure=False)
    assert capsys.readouterr().err == ""
    check_exposure("0.0.0.0", None, insecure=True)
    err = capsys.readouterr().err
    assert "WARNING" in err and "NO API key" in err and "0.0.0.0" in err
    with pytest.raises(ValueError, match="without an API key"):
        check_exposure("::", None, insecure=False)


def test_agent_proxy_refuses_an_open_non_loopback_address(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("POLYRL_API_KEY", raising=False)
    monkeypatch.delenv("POLYRL_PROXY_API_KEY", raising=False)
    args = ["agent-proxy", "--rollout", "http://127.0.0.1:1", "--tokenizer", str(tmp_path)]
    assert cli.main([*args, "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "without an API key" in err and "POLYRL_PROXY_API_KEY" in err and err.count("\n") == 1


def test_server_limit_flags_are_checked(tmp_path, capsys):
    assert cli.main(["serve", str(tmp_path), "--chat-template", "nofile"]) == 2
    assert "NAME=FILE" in capsys.readouterr().err


class FakeClient:
    """Stands in for the rollout client: answers every prompt with two tokens."""

    def __init__(self):
        self.calls = 0

    async def start(self):
        pass

    async def close(self):
        pass

    async def generate(self, prompt_ids, params, session_id=None):
        self.calls += 1
        out = SampleOutput(
            index=0, output_ids=[11, 12], logprobs=[-0.1, -0.2], finish_reason="length"
        )
        return RequestOutput(request_id="r", prompt_ids=list(prompt_ids), outputs=[out])


@pytest.fixture
def proxy(tiny_qwen2_tokenizer):
    return RecordingProxy(FakeClient(), tiny_qwen2_tokenizer)


def send(app, *requests):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://p") as client:
            return [await client.request(m, p, **kw) for m, p, kw in requests]

    return asyncio.run(go())


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def chat(key=None, session=None):
    headers = auth(key) if key else {}
    if session:
        headers["X-Session-Id"] = session
    return ("POST", "/v1/chat/completions", {"json": {"messages": MSGS}, "headers": headers})


def test_proxy_with_keys_rejects_anonymous_callers_and_forwards_nothing(proxy):
    app = create_proxy_app(proxy, api_keys=["ka", "kb"])
    rs = send(
        app,
        ("GET", "/health", {}),
        chat(),
        chat("wrong"),
        ("GET", "/v1/models", {}),
        ("GET", "/sessions/s/trajectory", {}),
        ("DELETE", "/sessions/s", {}),
    )
    assert rs[0].status_code == 200
    for r in rs[1:]:
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert proxy.client.calls == 0  # nothing reached the rollout server
    assert send(app, chat("ka"))[0].status_code == 200 and proxy.client.calls == 1


def test_proxy_sessions_are_scoped_per_key(proxy):
    app = create_proxy_app(proxy, api_keys=["ka", "kb"])
    (r,) = send(app, chat("ka", session="shared-name"))
    assert r.status_code == 200 and r.headers["x-session-id"] == "shared-name"
    get_a = ("GET", "/sessions/shared-name/trajectory", {"headers": auth("ka")})
    get_b = ("GET", "/sessions/shared-name/trajectory", {"headers": auth("kb")})
    del_b = ("DELETE", "/sessions/shared-name", {"headers": auth("kb")})
    ra, rb, rd, ra2 = send(app, get_a, get_b, del_b, get_a)
    assert ra.status_code == 200 and ra.json()["response_ids"] == [11, 12]
    assert rb.status_code == 404 and rd.status_code == 404  # B cannot see or end A's session
    assert ra2.status_code == 200
    # B may use the same name: a session of its own, A's is untouched.
    send(app, chat("kb", session="shared-name"), chat("kb", session="shared-name"))
    assert send(app, get_b)[0].json()["num_turns"] == 1
    assert send(app, get_a)[0].json()["num_turns"] == 1


def test_proxy_generated_session_ids_are_random(proxy):
    app = create_proxy_app(proxy)
    ids = {send(app, chat())[0].headers["x-session-id"] for _ in range(3)}
    assert len(ids) == 3
    assert all(i.startswith("session-") and len(i) == len("session-") + 32 for i in ids)


def test_proxy_bad_bodies_are_4xx(proxy):
    app = create_proxy_app(proxy, max_body_bytes=1 << 18)
    deep = b"[" * 100_000 + b"]" * 100_000
    for raw in (deep, b'{"messages": ' + b"9" * 5000 + b"}", b"{", b"[1]"):
        r = send(app, ("POST", "/v1/chat/completions", {"content": raw}))[0]
        assert r.status_code == 400, (raw[:10], r.text[:200])
    r = send(app, ("POST", "/v1/chat/completions", {"json": {"messages": MSGS, "seed": "x"}}))[0]
    assert r.status_code == 400
    bad_args = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000}}],
        },
        {"role": "tool", "content": "1"},
    ]
    r = send(app, ("POST", "/v1/chat/completions", {"json": {"messages": bad_args}}))[0]
    assert r.status_code < 500
    r = send(app, ("POST", "/v1/chat/completions", {"content": b"x" * (1 << 19)}))[0]
    assert r.status_code == 413
    spec = send(app, ("GET", "/openapi.json", {}))[0].json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert "messages" in body["content"]["application/json"]["schema"]["properties"]
