"""DPO on preference pairs with ``polyrl.DPOTrainer`` (in-memory rows in TRL's format).

What it shows: rows with ``prompt`` / ``chosen`` / ``rejected`` (here from the bundled
``arithmetic_pairs`` generator: a correct and a wrong answer to each sum) passed as Python
lists; the reference model is a frozen copy of the starting model (``ref_model=None``); the
``dpo`` group picks the loss (``dpo.loss_type``: sigmoid, ipo, simpo) and ``dpo.beta``. Held-out
preference accuracy is ``val/rewards/accuracies``. With no model directory a tiny random-init
model is built from ``model.tiny_arch`` / ``model.tiny_size``.

Run it::

    python examples/dpo_pairs.py --smoke     # 2 steps on a nano model (tests use this)
    python examples/dpo_pairs.py             # the dpo_demo preset's 20 steps, CPU, seconds

The same from the command line: ``polyrl dpo dpo_demo``. At full size pass ``--model DIR`` and
your own rows (or ``--set data.train_files=[pairs.parquet] --set trainer.device=cuda``).
"""

from __future__ import annotations

import argparse
import tempfile

from polyrl import DPOTrainer
from polyrl.config import load_config
from polyrl.data.tasks import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 tiny steps (for the tests)")
    parser.add_argument("--model", default=None, help="HF model directory (default: tiny)")
    parser.add_argument("--out", default="", help="output directory (default: a temp dir)")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="polyrl-example-")

    overrides = [f"trainer.output_dir={out}", "dpo.loss_type=sigmoid", "dpo.beta=0.5"]
    if args.smoke:
        overrides += ["trainer.total_steps=2", "trainer.test_freq=2", "trainer.save_freq=0"]
        overrides += ["data.num_train=32", "data.num_val=16", "trainer.val_before_train=false"]
    config = load_config("dpo_demo", [*overrides, *args.set])
    train = generate("arithmetic_pairs", config.data.num_train, seed=0, split="train")
    val = generate("arithmetic_pairs", config.data.num_val, seed=0, split="test")
    print("a pair:", {k: train[0][k] for k in ("prompt", "chosen", "rejected")})
    trainer = DPOTrainer(model=args.model, config=config, train_dataset=train, eval_dataset=val)
    summary = trainer.train()
    print({k: summary.get(k) for k in ("steps", "first_val_accuracy", "last_val_accuracy")})


if __name__ == "__main__":
    main()
