"""Benchmark: rollout server throughput vs. HF ``generate`` on padded static batches.

Load: 64 requests with mixed prompt lengths (16..256 tokens, uniform) and output lengths
(16..256 tokens, uniform), sampled at temperature 1 with ``ignore_eos`` so every request
produces exactly its length. All 64 are sent at once to a real server subprocess (native
backend) through :class:`~polyrl.rollout.client.RolloutClient`; a pass is timed from the first
send to the last answer. The time to first token (p50) comes from one extra, streaming pass.

Baseline: the same requests through ``model.generate`` in this process, in static batches of
64 (left padded; the batch runs until its longest request is done); only the tokens each request
asked for are counted. One pass with batches of 16 is timed too and the faster batch size is
the baseline. Server and baseline passes alternate for ``--rounds`` rounds (medians are kept)
so both see the same load on a shared machine; each side gets one untimed warm-up.

Where the ``vllm`` backend is registered and ``vllm`` imports, the same load also goes through a
``--backend vllm`` server; otherwise ``vllm_tokens_per_s`` is null.

Run: ``python benchmarks/rollout_throughput.py [--size nano|micro] [--threads N] [--rounds R]``.
The last stdout line is one JSON object, also appended to
``benchmarks/history/rollout_throughput.jsonl`` (see ``benchmarks/_report.py``):
``{"name": "rollout_throughput", "server_tokens_per_s",
"hf_generate_tokens_per_s", "ratio", "ttft_ms_p50", "vllm_tokens_per_s", ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from polyrl.models.loader import load_causal_lm  # noqa: E402
from polyrl.models.tiny import build_tiny_model  # noqa: E402
from polyrl.rollout.base import available_backends
from polyrl.rollout.client import RolloutClient  # noqa: E402
from polyrl.rollout.launcher import ServerProcess  # noqa: E402

try:  # run as a script: its own directory is on sys.path
    from _report import report
except ImportError:  # imported as benchmarks.rollout_throughput
    from benchmarks._report import report

NUM_REQUESTS = 64


def make_load(vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) for each request; ids avoid the control tokens."""
    rng = random.Random(seed)
    load = []
    for _ in range(NUM_REQUESTS):
        prompt_len = rng.randint(16, 256)
        out_len = rng.randint(16, 256)
        load.append(([rng.randrange(16, vocab) for _ in range(prompt_len)], out_len))
    return load


async def _server_pass(url: str, load: list[tuple[list[int], int]], stream: bool) -> dict:
    async with RolloutClient([url], max_concurrency=NUM_REQUESTS, health_interval=0) as client:
        # Warm-up: first forward passes allocate and pick kernels.
        await client.generate(load[0][0][:16], {"max_new_tokens": 4, "ignore_eos": True})
        ttfts: list[float] = []

        async def one(i: int, prompt: list[int], out_len: int) -> int:
            params = {"max_new_tokens": out_len, "ignore_eos": True, "seed": i}
            if not stream:
                result = await client.generate(prompt, params)
                return len(result.outputs[0].output_ids)
            sent = time.perf_counter()
            n = 0
            body = {"input_ids": prompt, "sampling_params": params, "stream": True}
            async for event in client.stream_events("/generate", body):
                if n == 0 and event["token_ids"]:
                    ttfts.append(time.perf_counter() - sent)
                n += len(event["token_ids"])
            return n

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(load)))
        wall = time.perf_counter() - start
    expected = sum(n for _, n in load)
    if sum(counts) != expected:
        raise RuntimeError(f"server produced {sum(counts)} tokens, expected {expected}")
    return {"tokens": expected, "seconds": wall, "ttfts": ttfts}


@torch.inference_mode()
def hf_generate_pass(model, load: list, batch_size: int, pad_id: int) -> float:
    """Seconds ``model.generate`` takes over static, left-padded batches of the load."""

    def run_batch(batch: list[tuple[list[int], int]]) -> None:
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        longest = max(n for _, n in batch)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=longest,
            min_new_tokens=longest,
            pad_token_id=pad_id,
        )

    start = time.perf_counter()
    for i in range(0, len(load), batch_size):
        run_batch(load[i : i + batch_size])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="micro", choices=("nano", "micro"))
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--model-dir", default=None, help="use this model instead of a tiny one")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (median is kept)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        cache = Path(tempfile.gettempdir()) / f"polyrl-bench-{args.arch}-{args.size}"
        model_dir = build_tiny_model(args.arch, cache, size=args.size)
    from polyrl.models.loader import load_tokenizer

    tok = load_tokenizer(model_dir)
    load = make_load(len(tok))
    tokens = sum(n for _, n in load)
    model = load_causal_lm(model_dir)
    hf_generate_pass(model, [(p[:16], 4) for p, _ in load[:8]], 8, tok.pad_token_id)  # warm-up

    # Server and baseline alternate, round by round, so both see the same machine load.
    # Each timed round draws fresh prompts (the same for both sides): resending the warm-up
    # prompts would let the server's prefix cache skip their prefill, which HF cannot do.
    server_tps_rounds: list[float] = []
    hf_tps_rounds: list[float] = []
    with ServerProcess(model_dir, options={"num_threads": args.threads}) as server:
        assert server.url is not None
        asyncio.run(_server_pass(server.url, load, stream=False))  # warm-up at full size
        for r in range(args.rounds):
            round_load = make_load(len(tok), seed=r + 1)
            round_tokens = sum(n for _, n in round_load)
            server_s = asyncio.run(_server_pass(server.url, round_load, stream=False))["seconds"]
            hf_s = hf_generate_pass(model, round_load, 64, tok.pad_token_id)
            server_tps_rounds.append(round_tokens / server_s)
            hf_tps_rounds.append(round_tokens / hf_s)
            print(f"round {r}: server {server_s:.2f} s, hf(64) {hf_s:.2f} s", file=sys.stderr)
        hf16_load = make_load(len(tok), seed=args.rounds + 1)
        hf16 = hf_generate_pass(model, hf16_load, 16, tok.pad_token_id)
        print(f"hf(16) {hf16:.2f} s", file=sys.stderr)
        streamed = asyncio.run(_server_pass(server.url, hf16_load, stream=True))
    server_tps = statistics.median(server_tps_rounds)
    hf64_tps = statistics.median(hf_tps_rounds)
    hf16_tps = sum(n for _, n in hf16_load) / hf16
    hf_tps, hf_bs = (hf64_tps, 64) if hf64_tps >= hf16_tps else (hf16_tps, 16)

    vllm_tps = None
    # vLLM lives in its own venv (.venv-vllm, see scripts/setup_vllm_venv.sh), not in this one.
    from polyrl.rollout.vllm_backend import vllm_available

    if "vllm" in available_backends() and vllm_available():
        with ServerProcess(model_dir, backend="vllm") as vserver:
            assert vserver.url is not None
            asyncio.run(_server_pass(vserver.url, load, stream=False))  # warm-up
            vllm_load = make_load(len(tok), seed=1)
            vllm_s = asyncio.run(_server_pass(vserver.url, vllm_load, stream=False))["seconds"]
            vllm_tps = sum(n for _, n in vllm_load) / vllm_s

    result = {
        "name": "rollout_throughput",
        "server_tokens_per_s": round(server_tps, 1),
        "hf_generate_tokens_per_s": round(hf_tps, 1),
        "ratio": round(server_tps / hf_tps, 2),
        "ttft_ms_p50": round(1000 * statistics.median(streamed["ttfts"]), 1),
        "vllm_tokens_per_s": None if vllm_tps is None else round(vllm_tps, 1),
        "hf_batch_size": hf_bs,
        "hf_batch16_tokens_per_s": round(hf16_tps, 1),
        "rounds": args.rounds,
        "model": f"{args.arch}-{args.size}" if not args.model_dir else str(model_dir),
        "requests": NUM_REQUESTS,
        "generated_tokens": tokens,
        "threads": args.threads,
    }
    report(result)


if __name__ == "__main__":
    main()
