"""Saves a checkpoint after every training step until killed (crash-during-save check).

Usage: ``ckpt_crash.py MODEL_DIR CKPT_ROOT``.  Prints ``saving N`` before and ``saved N`` after
each save so the test can SIGKILL it in the middle of one.
"""

from __future__ import annotations

import sys

from engine_common import make_batch

from polyrl.model_engine import EngineConfig, OptimizerConfig, build_engine, sft_loss


def main() -> None:
    model_dir, root = sys.argv[1], sys.argv[2]
    engine = build_engine(model_dir, EngineConfig(), OptimizerConfig(lr=1e-3))
    for step in range(1, 1000):
        engine.train_batch(make_batch(4, 12, 1000, seed=step), sft_loss)
        print(f"saving {step}", flush=True)
        engine.save_checkpoint(root, step, extra_state={"step": step})
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main()
