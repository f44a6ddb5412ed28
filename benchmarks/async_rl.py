"""Samples per second of sync, one_step_off and async GRPO on the demo's task and model.

One run: the demo's SFT warm-up once (its checkpoint is where every mode starts), then the
demo's GRPO for the same number of steps (so the same number of trained samples) in each
``trainer.mode``, each in a fresh child process:

* ``sync`` alternates generation and training, each phase with both cores of the machine
  (the rollout server and the engine use every core they can);
* ``one_step_off`` and ``async`` overlap them: the rollout server (and the reward worker) is
  pinned to core 0 with one thread, the trainer (its engine runs in-process) to core 1 with
  one thread.

Throughput is trained samples (prompts x ``rollout.n``) over the summed ``timing_s/step`` of
the run (set-up and validation excluded); accuracy is the held-out greedy accuracy after the
last step (``val/acc/mean@1``, 128 prompts). The last stdout line is the JSON result; ratio is
async over sync samples per second.

    python benchmarks/async_rl.py [--steps 150] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _report import report  # noqa: E402

MODES = ("sync", "one_step_off", "async")
ROLLOUT_CORE, TRAINER_CORE = 0, 1
# The sync job again with everything on one core and one thread: its phase times are the
# single-core costs that bound what overlapping the phases on two cores can gain.
ONE_CORE = "one_core"
ROLLOUT_PHASES = ("gen", "reward")  # on the rollout core when the phases overlap
NOT_PHASES = ("step", "testing")  # every other timing_s/* of a step is the engines' work


def _children(pid: int) -> list[int]:
    """Every descendant process of ``pid`` (from /proc)."""
    out, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for kid in map(int, kids):
                out.append(kid)
                frontier.append(kid)
    return out


def _pin(pid: int, core: int) -> None:
    """Pin every thread of process ``pid`` to ``core``."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            os.sched_setaffinity(int(task.name), {core})
        except OSError:
            pass  # the thread ended


def _is_engine_worker(pid: int) -> bool:
    """Whether ``pid`` is a Ray actor process of the engine group (``ray::EngineWorker...``)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::EngineWorker")
    except OSError:
        return False


def _keep_rollout_pinned(stop: threading.Event, engine_in_process: bool = True) -> None:
    """Pin everything but the engine to the rollout core, as it appears.

    That is the rollout server and the reward worker (child processes, with the threads they
    start) and this process's threads other than the main one, which runs the engine: the
    rollout thread (HTTP client, packing, scoring calls) and its helpers. With the engine in a
    Ray worker (``engine_in_process=False``) that worker goes to the trainer core and every
    thread of this process to the rollout core.
    """
    main = threading.main_thread()
    while not stop.wait(0.5):
        for kid in _children(os.getpid()):
            engine = not engine_in_process and _is_engine_worker(kid)
            _pin(kid, TRAINER_CORE if engine else ROLLOUT_CORE)
        for thread in threading.enumerate():
            if (thread is not main or not engine_in_process) and thread.native_id is not None:
                try:
                    os.sched_setaffinity(thread.native_id, {ROLLOUT_CORE})
                except OSError:
                    pass  # the thread ended


def warm_up(workdir: Path) -> tuple[str, list[str], list[str]]:
    """Run the demo's SFT warm-up (reused when ``workdir`` holds a finished one).

    Returns the warmed-up checkpoint, the train files and the held-out files.
    """
    from polyrl import demo
    from polyrl.config import load_config

    done = demo.warm_up(load_config("demo", [f"trainer.output_dir={workdir}"]))
    return str(done.sft["hf_model"]), list(done.data.train_files), list(done.data.val_files)


def run_mode(
    mode: str,
    model: str,
    train: str,
    test: str,
    steps: int,
    out: Path,
    extra: list[str],
    pin: bool = True,
) -> dict:
    """Run GRPO in ``mode`` in this process (pinned as the module docstring says)."""
    from polyrl.config import load_config
    from polyrl.trainer.rl import run_rl

    overrides = [
        f"model.path={model}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        f"trainer.test_freq={steps}",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        "trainer.export_hf=false",
        # The one-core run is the sync job, on one core.
        f"trainer.mode={'sync' if mode == ONE_CORE else mode}",
        *extra,
    ]
    stop = threading.Event()
    if mode != "sync":
        # One thread for the rollout server whichever the placement: it runs beside the engine.
        overrides.append("rollout.num_threads=1")
    if mode == ONE_CORE:
        import torch

        os.sched_setaffinity(0, {ROLLOUT_CORE})  # the children it starts inherit it
        torch.set_num_threads(1)
    elif mode != "sync" and pin:
        import torch

        in_process = "trainer.worker_backend=ray" not in extra
        os.sched_setaffinity(0, {TRAINER_CORE if in_process else ROLLOUT_CORE})
        torch.set_num_threads(1)
        keeper = threading.Thread(target=_keep_rollout_pinned, args=(stop, in_process), daemon=True)
        keeper.start()
    cfg = load_config("demo", overrides)
    try:
        run_rl(cfg)
    finally:
        stop.set()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "timing_s/step" in r]
    seconds = sum(r["timing_s/step"] for r in trained)
    samples = len(trained) * cfg.data.train_batch_size * cfg.rollout.n
    settled = trained[min(5, len(trained) - 1) :]  # past the first steps' warm-up
    phases = {
        key.removeprefix("timing_s/"): sum(r.get(key, 0.0) for r in settled) / len(settled)
        for key in sorted({k for r in settled for k in r if k.startswith("timing_s/")})
    }
    return {
        "samples_per_s": samples / seconds,
        "seconds": seconds,
        "samples": samples,
        "phase_s": phases,
        "accuracy": next(r["val/acc/mean@1"] for r in reversed(records) if "val/acc/mean@1" in r),
        "score_last10": sum(r["critic/score/mean"] for r in trained[-10:]) / 10,
    }


def overlap_bounds(sync_phases: dict, one_core_phases: dict) -> dict:
    """The most any overlap of generation and training can gain over sync on two cores.

    From the single-core cost of each phase: pinned (rollout work on one core, engine work on
    the other) a step takes at least the larger of the two; with both cores shared perfectly,
    at least half their sum. Both ignore every cost of overlapping (the GIL, shared memory
    bandwidth, the staleness gate).
    """
    rollout = sum(one_core_phases.get(p, 0.0) for p in ROLLOUT_PHASES)
    engine = sum(v for p, v in one_core_phases.items() if p not in (*ROLLOUT_PHASES, *NOT_PHASES))
    sync_step = sync_phases["step"]
    return {
        "one_core_rollout_s": round(rollout, 4),
        "one_core_engine_s": round(engine, 4),
        "sync_step_s": round(sync_step, 4),
        "bound_ratio_pinned": round(sync_step / max(rollout, engine), 3),
        "bound_ratio_two_cores": round(sync_step / ((rollout + engine) / 2), 3),
    }


def main() -> None:
    """Warm up once, run each mode in a child process, record and print the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="GRPO steps of each mode")
    parser.add_argument(
        "--modes",
        default=",".join((*MODES, ONE_CORE)),
        help=f"modes to run; {ONE_CORE!r} is sync on one core, for the overlap bound",
    )
    parser.add_argument(
        "--one-core-steps", type=int, default=30, help=f"steps of the {ONE_CORE!r} run"
    )
    parser.add_argument("--workdir", default=None)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the overlapped modes (e.g. async.correction=tis); repeatable",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="let the overlapped modes share both cores (the OS schedules rollout and engine)",
    )
    parser.add_argument("--child", nargs=5, metavar=("MODE", "MODEL", "TRAIN", "TEST", "OUT"))
    args = parser.parse_args()
    if args.child:
        mode, model, train, test, out = args.child
        extra = args.set if mode != "sync" else []
        result = run_mode(
            mode, model, train, test, args.steps, Path(out), extra, pin=not args.no_pin
        )
        print("CHILD " + json.dumps(result), flush=True)
        return
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="polyrl-async-"))
    tick = time.perf_counter()
    model, train, test = warm_up(workdir)
    print(f"[async_rl] SFT warm-up done in {time.perf_counter() - tick:.0f} s", flush=True)
    results = {}
    for mode in args.modes.split(","):
        steps = args.one_core_steps if mode == ONE_CORE else args.steps
        cmd = [sys.executable, __file__, "--steps", str(steps)]
        cmd += [f"--set={item}" for item in args.set] + (["--no-pin"] if args.no_pin else [])
        cmd += ["--child", mode, model, train[0], test[0], str(workdir / mode)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("CHILD ")), None)
        if proc.returncode or line is None:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"[async_rl] mode {mode} failed (exit {proc.returncode})")
        results[mode] = json.loads(line[len("CHILD ") :])
        r = results[mode]
        print(
            f"[async_rl] {mode:12s} {r['samples_per_s']:7.1f} samples/s "
            f"({r['samples']} in {r['seconds']:.1f} s), held-out accuracy {r['accuracy']:.3f}, "
            f"score (last 10 steps) {r['score_last10']:.3f}",
            flush=True,
        )
    out = {"name": "async_rl", "steps": args.steps}
    for mode, r in results.items():
        if mode != ONE_CORE:
            out[f"{mode}_samples_per_s"] = round(r["samples_per_s"], 2)
            out[f"{mode}_accuracy"] = round(r["accuracy"], 4)
    if "sync" in results and ONE_CORE in results:
        out.update(overlap_bounds(results["sync"]["phase_s"], results[ONE_CORE]["phase_s"]))
        print(f"[async_rl] single-core phase costs (s/step): {results[ONE_CORE]['phase_s']}")
    if "sync" in results and "async" in results:
        speed = {mode: r["samples_per_s"] for mode, r in results.items()}
        out["ratio"] = round(speed["async"] / speed["sync"], 3)
    else:
        out["ratio"] = None
    report(out)


if __name__ == "__main__":
    main()
