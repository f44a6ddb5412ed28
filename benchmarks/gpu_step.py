"""Benchmark on one CUDA GPU: generation, training MFU and weight sync of a ~0.5B model.

The model is a random-init Qwen2 built from a config (``polyrl.models.tiny``, no download):
hidden 1024, 24 layers, 16 query / 4 KV heads, MLP 5504, tied embeddings, about 0.47B
parameters. Its vocabulary is the local tiny tokenizer's 1024 ids, so nearly all of them sit
in the decoder layers (a real 0.5B Qwen2 spends ~0.14B on a 152k-token embedding).

1. Generation, bfloat16, greedy, ``--prompts`` prompts of ``--prompt-len`` random tokens, exactly
   ``--new-tokens`` new tokens each (eos ignored): polyrl's native engine in-process
   (``device="cuda"``, all prompts submitted at once) vs Hugging Face ``generate`` on the same
   prompts as one batch. Warm-up once each, then ``--rounds`` alternating timed runs; the best
   of each counts. ``ratio`` = native tokens/s over HF tokens/s (> 1: polyrl faster).
2. Training: ``train_batch`` of the FSDP2 engine (world size 1, NCCL group, fp32 master
   weights, bf16 compute, AdamW) on ``--train-rows`` x ``--train-len`` tokens in one
   micro-batch; median of ``--train-steps`` timed steps after one warm-up.
   ``mfu`` = 6 * parameters * tokens / step time / peak dense bf16 FLOP/s of the device (table
   below; ``null`` for a device not in it).
3. Weight sync: the engine's weights, cast to bf16 on the wire, into a native rollout replica
   serving on the same GPU in another process over the ``cuda_ipc`` transport (staged: atomic
   switch), ``--bucket-mb`` buckets; median of ``--sync-rounds`` after one warm-up update
   (which allocates the replica's shadows). ``GBps`` = wire bytes / seconds.

The last stdout line is the JSON result, also appended to ``benchmarks/history/gpu_step.jsonl``
(see ``benchmarks/_report.py``): ``{"name": "gpu_step", "device", "model_params",
"generation": {"polyrl_tokens_per_s", "hf_tokens_per_s", ...}, "training": {"step_s",
"tokens_per_s", "model_tflops_per_s", "peak_tflops_per_s", "mfu", ...}, "weight_sync":
{"bytes", "seconds", "GBps", ...}, "ratio"}``. Without CUDA it exits with status 2 and a
one-line error. About 2-3 minutes on an H100.

Usage: ``python benchmarks/gpu_step.py [--prompts 64] [--new-tokens 128] ...``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

try:  # run as a script: its own directory is on sys.path
    from _report import report
except ImportError:  # imported as benchmarks.gpu_step
    from benchmarks._report import report

#: Qwen2-0.5B-like dimensions (see the module docstring for the vocabulary).
MODEL_DIMS = {"hidden": 1024, "layers": 24, "heads": 16, "kv_heads": 4, "intermediate": 5504}

#: Peak dense bf16 tensor FLOP/s by device-name substring, first match wins (vendor figures
#: without sparsity). H100 SXM and H200 share the same tensor cores and clocks.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
)


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device from :data:`PEAK_BF16_FLOPS`; ``None`` if unknown."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


def random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids inside the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, 1000, (count, length), generator=g).tolist()


def native_generate(engine: Any, prompts: list[list[int]], new_tokens: int) -> int:
    """Greedy-generate ``new_tokens`` per prompt on a started native engine; tokens made."""
    from polyrl.core.rollout_api import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    left = [len(prompts)]
    made = [0]
    done = threading.Event()
    errors: list[BaseException] = []

    def sink(payload: Any) -> None:
        if isinstance(payload, BaseException):
            errors.append(payload)
            done.set()
            return
        for delta in payload:
            made[0] += len(delta.token_ids)
            if delta.finish_reason is not None:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    # A fresh id per call: ids must be unique among requests in flight.
    tag = time.perf_counter_ns()
    for i, p in enumerate(prompts):
        engine.submit(GenerateRequest(f"{tag}-{i}", tuple(p), params), sink, stream=False)
    if not done.wait(600):
        raise TimeoutError("the native engine did not finish in 600 s")
    if errors:
        raise errors[0]
    return made[0]


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> int:
    """Greedy-generate ``new_tokens`` per prompt with HF ``generate`` (one batch); tokens made."""
    ids = torch.tensor(prompts, device=model.device)  # equal lengths: no padding needed
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return int(out[:, ids.shape[1] :].numel())


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    """Seconds of ``fn(*args)`` with the GPU synchronised on both ends, and its result."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, result


def bench_generation(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Native engine vs HF ``generate`` tokens/s (best of ``args.rounds`` each)."""
    from polyrl.models.loader import load_causal_lm
    from polyrl.rollout.native import NativeEngine, NativeEngineConfig

    prompts = random_prompts(args.prompts, args.prompt_len)
    n, new = len(prompts), args.new_tokens
    config = NativeEngineConfig(
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=n,
        # The whole prefill in one step, as HF's single batched forward does it.
        max_num_batched_tokens=max(n * args.prompt_len, n),
        kv_cache_tokens=n * (args.prompt_len + new) + 1024,
    )
    engine = NativeEngine(model_dir, config)
    engine.start()
    model = load_causal_lm(model_dir, "bfloat16", "cuda")
    native_s: list[float] = []
    hf_s: list[float] = []
    try:
        native_generate(engine, prompts, 8)  # warm-up: kernels, allocator
        hf_generate(model, prompts, 8)
        for _ in range(args.rounds):  # alternate so drift hits both sides alike
            sec, made = timed(native_generate, engine, prompts, new)
            assert made == n * new, (made, n * new)
            native_s.append(sec)
            sec, made = timed(hf_generate, model, prompts, new)
            assert made == n * new, (made, n * new)
            hf_s.append(sec)
    finally:
        engine.shutdown()
        del model
        torch.cuda.empty_cache()
    tokens = n * new
    return {
        "prompts": n,
        "prompt_len": args.prompt_len,
        "new_tokens": new,
        "dtype": "bfloat16",
        "polyrl_seconds": round(min(native_s), 4),
        "hf_seconds": round(min(hf_s), 4),
        "polyrl_tokens_per_s": round(tokens / min(native_s), 1),
        "hf_tokens_per_s": round(tokens / min(hf_s), 1),
    }


def train_batch_of(rows: int, length: int) -> Any:
    """Full-length random rows with a loss on every token after the first."""
    from polyrl.core.batch import Batch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(16, 1000, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    loss_mask = torch.ones(rows, length, dtype=torch.float32)
    return Batch(tensors={"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask})


def bench_training(engine: Any, params: int, args: argparse.Namespace) -> dict[str, Any]:
    """Median ``train_batch`` step time and the model-FLOPs utilisation it implies."""
    from polyrl.model_engine import sft_loss

    batch = train_batch_of(args.train_rows, args.train_len)
    tokens = args.train_rows * args.train_len
    engine.train_batch(batch, sft_loss)  # warm-up: optimizer state, allocator, kernels
    times = [timed(engine.train_batch, batch, sft_loss)[0] for _ in range(args.train_steps)]
    step = statistics.median(times)
    achieved = 6.0 * params * tokens / step
    name = torch.cuda.get_device_name()
    peak = peak_flops(name)
    return {
        "tokens_per_step": tokens,
        "rows": args.train_rows,
        "seq_len": args.train_len,
        "step_s": round(step, 4),
        "tokens_per_s": round(tokens / step, 1),
        "model_tflops_per_s": round(achieved / 1e12, 2),
        "peak_tflops_per_s": None if peak is None else round(peak / 1e12, 1),
        "mfu": None if peak is None else round(achieved / peak, 4),
        "compute_dtype": "bfloat16",
    }


def bench_weight_sync(engine: Any, replica: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Median seconds of a full bf16 update over ``cuda_ipc`` into the running replica."""
    from polyrl.weights import WeightSender, create_transport

    transport = create_transport("cuda_ipc", urls=[replica.url], timeout=600)
    try:
        sender = WeightSender(transport, bucket_mb=args.bucket_mb, dtype=torch.bfloat16)
        sender.send(engine.named_tensors())  # warm-up: buffers, handles, replica shadows
        stats = [sender.send(engine.named_tensors()) for _ in range(args.sync_rounds)]
    finally:
        transport.close()
    seconds = statistics.median(s.seconds for s in stats)
    nbytes = stats[0].bytes
    return {
        "transport": "cuda_ipc",
        "mode": "staged",
        "bucket_mb": args.bucket_mb,
        "wire_dtype": "bfloat16",
        "bytes": nbytes,
        "seconds": round(seconds, 4),
        "GBps": round(nbytes / seconds / 1e9, 3),
        "versions": stats[-1].replica_versions,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the model, run the three measurements, return the result record."""
    from polyrl.model_engine import EngineConfig, OptimizerConfig, build_engine
    from polyrl.models.tiny import build_tiny_model
    from polyrl.rollout.launcher import ServerProcess

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="polyrl-gpu-step-"))
    t0 = time.perf_counter()
    model_dir = build_tiny_model("qwen2", workdir / "qwen2-0.5b", size="small", **MODEL_DIMS)
    print(f"[gpu_step] model built in {time.perf_counter() - t0:.1f} s: {model_dir}", flush=True)
    # The replica loads while generation is measured; it only idles until the weight sync.
    replica = ServerProcess(
        model_dir,
        options={"device": "cuda", "dtype": "bfloat16", "kv_cache_tokens": 4096},
        env={"POLYRL_WEIGHTS_CUDA_IPC": "1"},
    ).spawn()
    engine = None
    try:
        generation = bench_generation(model_dir, args)
        print(f"[gpu_step] generation {generation}", flush=True)
        engine = build_engine(
            str(model_dir),
            EngineConfig(
                device="cuda",
                max_tokens_per_micro_batch=args.train_rows * args.train_len,
                grad_clip=1.0,
            ),
            OptimizerConfig(lr=1e-5),
        )
        params = sum(p.numel() for p in engine.model.parameters())
        training = bench_training(engine, params, args)
        print(f"[gpu_step] training {training}", flush=True)
        replica.wait_ready(timeout=600)
        weight_sync = bench_weight_sync(engine, replica, args)
        print(f"[gpu_step] weight sync {weight_sync}", flush=True)
    finally:
        replica.stop()
        if engine is not None:
            engine.close()
    return {
        "name": "gpu_step",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model_params": params,
        "model_dims": MODEL_DIMS,
        "generation": generation,
        "training": training,
        "weight_sync": weight_sync,
        "ratio": round(generation["polyrl_tokens_per_s"] / generation["hf_tokens_per_s"], 4),
    }


def main() -> None:
    """Parse arguments, check for CUDA, run, record and print the JSON result last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="generation prompts")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--rounds", type=int, default=2, help="timed generation rounds (best)")
    parser.add_argument("--train-rows", type=int, default=16, help="rows per training step")
    parser.add_argument("--train-len", type=int, default=512, help="tokens per training row")
    parser.add_argument("--train-steps", type=int, default=3, help="timed steps (median)")
    parser.add_argument("--bucket-mb", type=float, default=256.0, help="weight-sync bucket MiB")
    parser.add_argument("--sync-rounds", type=int, default=3, help="timed updates (median)")
    parser.add_argument("--workdir", default=None, help="where the model is built")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_step: CUDA is not available (needs an NVIDIA GPU and a CUDA build of torch)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    report(run(args))


if __name__ == "__main__":
    main()
