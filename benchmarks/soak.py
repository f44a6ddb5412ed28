"""Soak: many concurrent clients against one native rollout server for a bounded time.

Load: ``--clients`` (default 64) clients, each sending one request after another until
``--duration`` seconds (default 60) have passed, to a real server subprocess (native backend,
tiny "nano" Qwen2, 127.0.0.1 only). Each request is drawn at random (seeded): 65% token-in
``/generate`` (prompt 16..128 tokens, 8..48 new tokens, sometimes ``n`` = 2 or streamed),
20% ``/v1/chat/completions``, 10% ``/v1/completions`` with text, and 5% malformed on purpose
(deep nesting, a 5,000-digit integer, wrong types, a duplicate in-flight ``request_id``),
which must get a 4xx. A separate process polls ``/health`` every 0.2 s throughout (its own
process, so the figure is the server's and not this process's busy event loop).

Figures: ``requests`` (well-formed ones), ``errors`` (a well-formed request not answered 200,
a malformed one not answered 4xx, or a transport failure), ``http_5xx``, ``p50_ms``/``p99_ms``
(latency of well-formed requests), ``tokens_per_s`` (completion tokens over the run),
``health_max_ms``/``health_p99_ms``, ``rss_growth_mb`` (the server's resident memory at the
end minus after warm-up). There is no baseline server to compare with: ``ratio`` is the
fraction of requests answered as they should be (1.0 = no errors and no 5xx; goal 1.0).

Not part of ``make test``. Run: ``python benchmarks/soak.py [--clients N] [--duration S]``.
The last stdout line is one JSON object (see ``benchmarks/_report.py``) with ``name: "soak"``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402

from polyrl.models.tiny import build_tiny_model  # noqa: E402
from polyrl.rollout.launcher import ServerProcess  # noqa: E402

try:  # run as a script: its own directory is on sys.path
    from _report import report
except ImportError:  # imported as benchmarks.soak
    from benchmarks._report import report

OPTIONS = {
    "num_threads": 1,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 512,
    "kv_cache_tokens": 32768,
    "max_model_len": 1024,
}
MALFORMED = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"input_ids": [' + b"9" * 5000 + b"]}",
    b'{"input_ids": "hello"}',
    b'{"input_ids": [1, 2], "sampling_params": {"n": 100000}}',
    b"{not json",
]


PROBE = """
import json, sys, time, httpx
url, until = sys.argv[1], time.time() + float(sys.argv[2])
lat, bad = [], 0
with httpx.Client(base_url=url, timeout=60) as http:
    while time.time() < until:
        t0 = time.perf_counter()
        bad += http.get("/health").status_code != 200
        lat.append(time.perf_counter() - t0)
        time.sleep(0.2)
print(json.dumps({"lat": lat, "bad": bad}))
"""


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Stats:
    def __init__(self) -> None:
        self.requests = 0
        self.malformed = 0
        self.errors = 0
        self.http_5xx = 0
        self.tokens = 0
        self.latencies: list[float] = []
        self.health: list[float] = []
        self.samples: list[str] = []

    def fail(self, what: str) -> None:
        self.errors += 1
        if len(self.samples) < 5:
            self.samples.append(what[:300])


async def one_request(http: httpx.AsyncClient, rng: random.Random, stats: Stats, i: int) -> None:
    kind = rng.random()
    if kind < 0.05:
        stats.malformed += 1
        if rng.random() < 0.3:  # a duplicate in-flight id: the second must get 409
            body = {
                "input_ids": [rng.randrange(16, 500) for _ in range(8)],
                "sampling_params": {"max_new_tokens": 32, "ignore_eos": True},
                "request_id": f"dup-{i}",
            }
            first = asyncio.ensure_future(http.post("/generate", json=body))
            await asyncio.sleep(0.05)
            r = await http.post("/generate", json=body)
            done = await first
            # One is answered, the other gets 409 -- whichever reached the server first (both
            # 200 when the first had finished already).
            ok = sorted((r.status_code, done.status_code)) in ([200, 409], [200, 200])
            if done.status_code >= 500:
                stats.http_5xx += 1
        else:
            raw = rng.choice(MALFORMED)
            r = await http.post(
                "/generate", content=raw, headers={"content-type": "application/json"}
            )
            ok = 400 <= r.status_code < 500
        if r.status_code >= 500:
            stats.http_5xx += 1
        if not ok:
            stats.fail(f"malformed: {r.status_code} {r.text[:200]}")
        return
    stats.requests += 1
    max_new = rng.randint(8, 48)
    t0 = time.perf_counter()
    tokens = 0
    if kind < 0.70:
        prompt = [rng.randrange(16, 500) for _ in range(rng.randint(16, 128))]
        params = {"max_new_tokens": max_new, "ignore_eos": True, "seed": i}
        if rng.random() < 0.2:
            params["n"] = 2
        if rng.random() < 0.2:
            body = {"input_ids": prompt, "sampling_params": params, "stream": True}
            status = 0
            async with http.stream("POST", "/generate", json=body) as r:
                status = r.status_code
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        tokens += len(json.loads(line[6:])["token_ids"])
            r_status, text = status, ""
        else:
            r = await http.post("/generate", json={"input_ids": prompt, "sampling_params": params})
            r_status, text = r.status_code, r.text
            if r.status_code == 200:
                tokens = r.json()["usage"]["completion_tokens"]
    elif kind < 0.90:
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(20))
        body = {
            "messages": [{"role": "user", "content": words}],
            "max_tokens": max_new,
            "seed": i,
        }
        r = await http.post("/v1/chat/completions", json=body)
        r_status, text = r.status_code, r.text
        if r.status_code == 200:
            tokens = r.json()["usage"]["completion_tokens"]
    else:
        body = {"prompt": "count: one two three", "max_tokens": max_new, "seed": i}
        r = await http.post("/v1/completions", json=body)
        r_status, text = r.status_code, r.text
        if r.status_code == 200:
            tokens = r.json()["usage"]["completion_tokens"]
    stats.latencies.append(time.perf_counter() - t0)
    if r_status >= 500:
        stats.http_5xx += 1
    if r_status != 200:
        stats.fail(f"{r_status} {text}")
    stats.tokens += tokens


async def soak(url: str, clients: int, duration: float, seed: int) -> tuple[Stats, float]:
    stats = Stats()
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    timeout = httpx.Timeout(120.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
        start = time.perf_counter()
        deadline = start + duration

        async def client(c: int) -> None:
            rng = random.Random(seed * 1000 + c)
            i = 0
            while time.perf_counter() < deadline:
                try:
                    await one_request(http, rng, stats, c * 1_000_000 + i)
                except httpx.HTTPError as exc:
                    stats.fail(f"transport: {type(exc).__name__}: {exc}")
                i += 1

        probe = subprocess.Popen(
            [sys.executable, "-c", PROBE, url, str(duration)], stdout=subprocess.PIPE, text=True
        )
        await asyncio.gather(*(client(c) for c in range(clients)))
        elapsed = time.perf_counter() - start
        out, _ = probe.communicate(timeout=120)
        try:
            probed = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            stats.fail("the /health probe gave no result")
        else:
            stats.health = probed["lat"]
            for _ in range(probed["bad"]):
                stats.fail("health not 200")
        return stats, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--size", default="nano")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model("qwen2", Path(tmp) / "model", size=args.size)
        options = {**OPTIONS, "num_threads": args.threads}
        proc = ServerProcess(model, options=options).start(timeout=300)
        try:
            pid = proc.process.pid
            # Warm-up (first passes allocate), then the baseline memory.
            asyncio.run(soak(proc.url, 4, 3.0, seed=10_000))
            rss0 = rss_mb(pid)
            stats, elapsed = asyncio.run(soak(proc.url, args.clients, args.duration, args.seed))
            rss1 = rss_mb(pid)
        finally:
            code = proc.stop()
        if code != 0:
            print(proc.log_tail(), file=sys.stderr)
    lat = sorted(stats.latencies) or [float("nan")]
    health = sorted(stats.health) or [float("nan")]
    total = stats.requests + stats.malformed
    ratio = 1.0 - (stats.errors / total if total else 1.0)
    for sample in stats.samples:
        print(f"error: {sample}", file=sys.stderr)
    report(
        {
            "name": "soak",
            "clients": args.clients,
            "duration_s": round(elapsed, 1),
            "requests": stats.requests,
            "malformed_requests": stats.malformed,
            "errors": stats.errors,
            "http_5xx": stats.http_5xx,
            "p50_ms": round(statistics.median(lat) * 1e3, 1),
            "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3, 1),
            "tokens_per_s": round(stats.tokens / elapsed, 1),
            "health_max_ms": round(max(health) * 1e3, 1),
            "health_p99_ms": round(health[min(len(health) - 1, int(0.99 * len(health)))] * 1e3, 1),
            "rss_growth_mb": round(rss1 - rss0, 1),
            "server_exit_code": code,
            "ratio": round(ratio, 4),
        }
    )


if __name__ == "__main__":
    main()
