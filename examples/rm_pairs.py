"""A reward model trained on preference pairs, then scored with Hugging Face transformers.

What it shows: ``polyrl.RewardModelTrainer`` on the ``rm_demo`` preset (the bundled
``arithmetic_pairs`` task, Bradley-Terry loss on the score at each sequence's last token), and
the exported ``hf_model`` directory loaded with ``AutoModelForSequenceClassification`` to score
a correct and a wrong answer. Rows may carry a ``margin`` column (``rm.margin_key``).

Run it::

    python examples/rm_pairs.py --smoke      # 2 steps on a nano model (tests use this)
    python examples/rm_pairs.py              # the rm_demo preset's 20 steps, CPU, seconds

The same from the command line: ``polyrl rm rm_demo``; at full size
``--set model.path=/models/Qwen2.5-0.5B-Instruct --set data.task= --set
data.train_files=[pairs.parquet] --set trainer.device=cuda``.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from polyrl import RewardModelTrainer
from polyrl.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 tiny steps (for the tests)")
    parser.add_argument("--out", default="", help="output directory (default: a temp dir)")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="polyrl-example-")

    overrides = [f"trainer.output_dir={out}"]
    if args.smoke:
        overrides += ["trainer.total_steps=2", "trainer.test_freq=2", "trainer.save_freq=0"]
        overrides += ["data.num_train=32", "data.num_val=16", "trainer.val_before_train=false"]
    config = load_config("rm_demo", [*overrides, *args.set])
    summary = RewardModelTrainer(model=None, config=config).train()
    print({k: summary.get(k) for k in ("steps", "first_val_accuracy", "last_val_accuracy")})

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(summary["hf_model"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(summary["hf_model"])
    prompt = [{"role": "user", "content": "12+7="}]
    for answer in ("19", "194"):
        text = tokenizer.apply_chat_template(
            [*prompt, {"role": "assistant", "content": answer}], tokenize=False
        )
        ids = tokenizer(text.rstrip("\n"), return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            score = model(**ids).logits[0, 0].item()
        print(f"score of {answer!r}: {score:.3f}")


if __name__ == "__main__":
    main()
