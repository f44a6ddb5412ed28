"""The recording proxy (``polyrl agent-proxy``) driven by an agent written for the openai client."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from polyrl.agent.proxy import RecordingProxy
from polyrl.agent.tools import safe_calculate

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def server(agent_server):
    return agent_server


@pytest.fixture(scope="module")
def tok(tiny_qwen2_tokenizer):
    return tiny_qwen2_tokenizer


@pytest.fixture(scope="module")
def proxy_url(server, tiny_qwen2_dir, tmp_path_factory):
    ready = tmp_path_factory.mktemp("proxy") / "ready.json"
    log = open(ready.with_name("proxy.log"), "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "polyrl.cli", "agent-proxy", "--rollout", server.url]
        + ["--tokenizer", str(tiny_qwen2_dir), "--port", "0", "--ready-file", str(ready)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, Path(log.name).read_text()
        assert time.monotonic() < deadline, "proxy did not come up"
        time.sleep(0.1)
    url = json.loads(ready.read_text())["url"]
    assert url.startswith("http://127.0.0.1:")
    yield url
    proc.terminate()
    assert proc.wait(timeout=30) == 0, Path(log.name).read_text()
    log.close()


def calculator_agent(client: openai.OpenAI, session: str, turns: int) -> list[dict]:
    """A small agent written only against the OpenAI API: it asks, reads the reply, runs the
    calculator on a follow-up question and sends the result back as a tool message."""
    messages: list[dict] = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "What is 12 * 7?"},
    ]
    for turn in range(turns):
        reply = client.chat.completions.create(
            model="polyrl",
            messages=messages,
            tools=TOOLS,
            max_tokens=12,
            temperature=0,
            extra_headers={"X-Session-Id": session},
        )
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        if turn % 2 == 0:
            messages.append({"role": "tool", "content": str(safe_calculate(f"12 * 7 + {turn}"))})
        else:
            messages.append({"role": "user", "content": "Are you sure? Check again."})
    return messages


def test_proxy_records_drift_free_trajectory(proxy_url, server, tok):
    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="unused", max_retries=0)
    calculator_agent(client, "agent-1", turns=3)
    traj = httpx.get(f"{proxy_url}/sessions/agent-1/trajectory").json()
    assert traj["num_segments"] == 1 and traj["num_turns"] == 3
    prompt, resp, mask = traj["prompt_ids"], traj["response_ids"], traj["response_mask"]
    assert len(resp) == len(mask) == len(traj["rollout_log_probs"])
    # Check against the server itself: re-generate each model turn greedily from exactly the
    # recorded context; the recorded model tokens must be what the server produces there.
    starts = [i for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0)]
    assert len(starts) == 3
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for start in starts:
            end = next((i for i in range(start, len(mask)) if mask[i] == 0), len(mask))
            r = http.post(
                "/generate",
                json={
                    "input_ids": prompt + resp[:start],
                    "sampling_params": {"max_new_tokens": 12, "temperature": 0, "logprobs": True},
                },
            )
            assert r.status_code == 200, r.text
            out = r.json()["outputs"][0]
            assert resp[start:end] == out["output_ids"]
            assert traj["rollout_log_probs"][start:end] == pytest.approx(out["logprobs"], abs=1e-4)
    # the non-model tokens are the chat template's text for the tool/user messages
    env_text = tok.decode([t for t, m in zip(resp, mask, strict=True) if m == 0])
    assert "<tool_response>84</tool_response>" in env_text
    assert "Are you sure? Check again." in env_text
    assert env_text.count("<|im_start|>assistant\n") == 2
    assert prompt == tok.encode(
        tok.apply_chat_template(
            traj["messages"][:2], tools=TOOLS, add_generation_prompt=True, tokenize=False
        ),
        add_special_tokens=False,
    )


def test_proxy_sessions_by_user_field_rewrites_and_errors(proxy_url):
    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="unused", max_retries=0)
    first = [{"role": "user", "content": "hello"}]
    r1 = client.chat.completions.create(
        model="polyrl", messages=first, max_tokens=4, temperature=0, user="u-7"
    )
    echoed = r1.choices[0].message.model_dump(exclude_none=True)
    client.chat.completions.create(
        model="polyrl",
        messages=[*first, echoed, {"role": "user", "content": "more"}],
        max_tokens=4,
        user="u-7",
    )
    # an agent that edits its history starts a new segment instead of corrupting the first
    client.chat.completions.create(
        model="polyrl",
        messages=[
            *first,
            {"role": "assistant", "content": "edited"},
            {"role": "user", "content": "x"},
        ],
        max_tokens=4,
        user="u-7",
    )
    traj = httpx.get(f"{proxy_url}/sessions/u-7/trajectory").json()
    assert traj["num_segments"] == 2
    assert [s["num_turns"] for s in traj["segments"]] == [2, 1]
    assert httpx.get(f"{proxy_url}/sessions/nope/trajectory").status_code == 404
    with pytest.raises(openai.BadRequestError, match="does not stream"):
        client.chat.completions.create(model="polyrl", messages=first, stream=True, user="u-8")
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="polyrl", messages=[], user="u-8")
    for bad in (
        {"messages": [{"role": "assistant", "tool_calls": "x"}]},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": "hi"}], "n": 2},
        {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {}},
        {"messages": [{"role": "robot", "content": "hi"}]},
    ):
        r = httpx.post(f"{proxy_url}/v1/chat/completions", json=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"], (bad, r.text)
    assert httpx.delete(f"{proxy_url}/sessions/u-7").json()["ended"] is True
    assert httpx.get(f"{proxy_url}/sessions/u-7/trajectory").status_code == 404


def test_proxy_reply_turns_hermes_calls_into_tool_calls(tok):
    proxy = RecordingProxy(client=None, tokenizer=tok)
    reply = proxy._reply(
        'Let me compute.<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}'
        "</tool_call>",
        with_tools=True,
    )
    assert reply["content"] == "Let me compute."
    (call,) = reply["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "1+2"}'}
    assert proxy._reply("plain", with_tools=True) == {"role": "assistant", "content": "plain"}


def test_agent_proxy_cli_rejects_bad_arguments(tmp_path, capsys):
    from polyrl import cli

    assert cli.main(["agent-proxy", "--rollout", "ftp://x", "--tokenizer", str(tmp_path)]) == 2
    assert "must start with http://" in capsys.readouterr().err
    missing = str(tmp_path / "nope")
    assert cli.main(["agent-proxy", "--rollout", "http://127.0.0.1:1", "--tokenizer", missing]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert cli.main(["agent-proxy", "--rollout", "http://127.0.0.1:1"]) == 2
    assert "pass --tokenizer DIR" in capsys.readouterr().err
    url = ["agent-proxy", "--rollout", "http://127.0.0.1:1", "--tokenizer", str(tmp_path)]
    for bad, words in (("{tokenize: true}", r"may not set ['tokenize']"), ("[1]", "a mapping")):
        assert cli.main([*url, "--chat-template-kwargs", bad]) == 2
        assert words in capsys.readouterr().err
