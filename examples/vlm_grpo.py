"""GRPO of a vision-language model from Python, on rows that carry their images.

What it shows: ``polyrl.GRPOTrainer`` on verl-layout multi-modal rows (``images: [{"bytes":
...}]`` and ``<image>`` in the prompt text), the same trainer and options as a text model: the
model's processor is found from the model directory, the images go to the rollout server with
each prompt and to the engines with each row (once per prompt, shared by its ``rollout.n``
samples).

The task: ``visual_count`` (polyrl.data.tasks), "How many red shapes?" over a 56x56 image
drawn with Pillow, scored by the built-in ``visual_count`` rule (the row's ``data_source``).

Run it::

    python examples/vlm_grpo.py --smoke     # 2 steps on a random-init tiny Qwen2-VL (tests)
    python examples/vlm_grpo.py --model /models/Qwen2.5-VL-3B-Instruct --steps 100 --set
        trainer.device=cuda                 # a real VLM (untested on GPU), on one line

A random-init model answers at chance; `make demo-vlm` warms one up with SFT first.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from polyrl import GRPOTrainer
from polyrl.config import load_config
from polyrl.data.tasks import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 tiny steps (for the tests)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", default="", help="HF VLM directory (default: a tiny one)")
    parser.add_argument("--out", default="", help="output directory (default: a temp dir)")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="polyrl-vlm-"))

    model = args.model
    if not model:
        from polyrl.models.tiny import build_tiny_model

        model = str(build_tiny_model("qwen2_vl", out / "tiny-vl"))

    steps = 2 if args.smoke else args.steps
    overrides = [
        f"trainer.output_dir={out / 'run'}",
        f"trainer.total_steps={steps}",
        "trainer.device=cpu",
        "trainer.worker_backend=local",
        "trainer.loggers=[console,jsonl]",
        "trainer.test_freq=" + str(max(steps // 2, 1)),
        "data.train_batch_size=4" if args.smoke else "data.train_batch_size=16",
        *args.set,
    ]
    config = load_config("grpo_vlm", overrides)
    # Rows as verl's geo3k preprocessing writes them: images as PNG bytes, "<image>" in text.
    train = generate("visual_count", 64 if args.smoke else 1000, seed=0, split="train")
    test = generate("visual_count", 8 if args.smoke else 64, seed=0, split="test")
    trainer = GRPOTrainer(model=model, config=config, train_dataset=train, eval_dataset=test)
    summary = trainer.train()
    keys = ("steps", "first_val_acc", "last_val_acc", "hf_model")
    print("vlm grpo", {k: summary.get(k) for k in keys})


if __name__ == "__main__":
    main()
