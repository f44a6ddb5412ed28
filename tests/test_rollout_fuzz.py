"""A real rollout server process: /health stays fast under a slow prompt; a schema fuzz.

The fuzz is schemathesis over the server's own OpenAPI schema: for every operation, bodies
that fit the schema and bodies that do not (30 each, derandomized), against the tiny model.
Any 5xx fails. The server is put back (woken up, resumed) after each call, so one case's
``/sleep`` does not turn the next one's answer into a 503.

The server runs ``polyrl.rollout.server``, without the ``/weights/*`` routes: a fuzzed
``/weights/dist/init`` would make it connect to whatever host the body names (only loopback
traffic is allowed here). Their bodies are covered by tests/test_rollout_hardening.py.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.generation import GenerationMode

from polyrl.rollout.launcher import ServerProcess
from polyrl.rollout.options import ServerLimits

OPTIONS = {
    "num_threads": 1,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 128,
    "kv_cache_tokens": 4096,
    "max_model_len": 256,
}
# Pure-Python Jinja work: ~15 million loop steps under the sandbox's range cap.
SLOW_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
    "{{ messages[0]['content'] }}"
)
EXAMPLES = 30


@pytest.fixture(scope="module")
def server(tiny_qwen2_dir):
    limits = ServerLimits(allow_request_chat_template=True, render_timeout=120.0)
    proc = ServerProcess(
        tiny_qwen2_dir, options=OPTIONS, limits=limits, module="polyrl.rollout.server"
    ).start(timeout=180)
    yield proc
    assert proc.stop() == 0, proc.log_tail()


def test_health_answers_while_a_prompt_renders(server):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"chat_template": SLOW_TEMPLATE},
        "max_tokens": 2,
    }
    result: dict = {}

    def slow() -> None:
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
        result["status"], result["seconds"] = r.status_code, time.monotonic() - t0

    thread = threading.Thread(target=slow)
    thread.start()
    latencies = []
    with httpx.Client(base_url=server.url, timeout=30) as http:
        time.sleep(0.3)  # the slow request is rendering now
        while thread.is_alive():
            t0 = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.1)
    thread.join()
    assert result["status"] == 200 and result["seconds"] > 1.0, result
    assert len(latencies) >= 5, (latencies, result)
    print(f"/health during a {result['seconds']:.1f} s render: max {max(latencies) * 1e3:.0f} ms")
    assert max(latencies) < 1.0, latencies


def _restore(http: httpx.Client) -> None:
    http.post("/wake_up", json={})
    http.post("/resume")
    http.post("/abort", json={})


def _fuzz(url: str, http: httpx.Client, op, mode, failures: list[str], counts: dict) -> None:
    """Run ``EXAMPLES`` derandomized cases of ``op`` in ``mode``; record any 5xx."""
    label = f"{op.method.upper()} {op.path}"

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case) -> None:
        response = case.call(base_url=url, timeout=60)
        counts[label] = counts.get(label, 0) + 1
        if response.status_code >= 500:
            failures.append(
                f"{label} -> {response.status_code}: body={case.body!r:.300} "
                f"answer={response.text[:300]}"
            )
        _restore(http)

    run()


@pytest.mark.slow
def test_schema_fuzz_never_gets_a_5xx(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    operations = [op for op in operations if not op.path.startswith("/weights/")]
    posts = {op.path for op in operations if op.method.upper() == "POST"}
    assert {"/generate", "/v1/chat/completions", "/update_weights"} <= posts
    failures: list[str] = []
    counts: dict[str, int] = {}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                if mode is GenerationMode.NEGATIVE and not len(op.body):
                    continue  # nothing to make malformed
                _fuzz(server.url, http, op, mode, failures, counts)
    print(dict(sorted(counts.items())))
    assert not failures, "\n".join(failures[:10])
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
