"""SFT on chat rows: a few hand-written conversations plus the bundled arithmetic task.

What it shows: the data supervised fine-tuning takes and a run of it from Python. A row is either
a chat (a ``messages`` list of ``{"role", "content"}`` dicts, several turns allowed, with an
optional ``tools`` list) or an RL prompt row in the verl schema, whose ``prompt`` plus
``reward_model.ground_truth`` becomes a two-turn chat. The loss is on the assistant turns only
(each up to its end-of-turn token), as rendered by the model's chat template. The rows go to
``data.train_files`` (parquet or jsonl); ``polyrl.trainer.sft.run_sft``, the function behind
``polyrl sft``, trains, validates, checkpoints and exports ``<out>/hf_model``. With no
``model.path`` it builds the tiny random-init model of the ``sft_demo`` preset; the end of the
script answers a held-out sum with the trained model.

Run it::

    python examples/sft_chat.py --smoke     # 2 steps on a nano model (tests use this)
    python examples/sft_chat.py             # the sft_demo preset's 60 steps, CPU, under a minute

The same from the command line: ``polyrl sft sft_demo data.task= data.train_files=[chats.jsonl]``.
At full size pass ``--set model.path=/models/Qwen2.5-0.5B-Instruct --set trainer.device=cuda``
and ``sft.optim.lr`` of about 1e-5.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from polyrl.config import load_config
from polyrl.data.tasks import generate
from polyrl.trainer.sft import run_sft

#: Hand-written chats: a system message, and a follow-up turn that needs the first answer. Every
#: assistant turn is learned, the system and user turns are context only.
CHATS = [
    [
        {"role": "system", "content": "Answer with the number only."},
        {"role": "user", "content": "2+3="},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "plus 4?"},
        {"role": "assistant", "content": "9"},
    ],
    [
        {"role": "user", "content": "10-7="},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "times 2?"},
        {"role": "assistant", "content": "6"},
    ],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hi! Send me a sum."},
    ],
]


def write_jsonl(rows: list[dict], path: Path) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 tiny steps (for the tests)")
    parser.add_argument("--out", default="", help="output directory (default: a temp dir)")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="polyrl-example-"))
    out.mkdir(parents=True, exist_ok=True)

    num_train, num_val = (32, 8) if args.smoke else (512, 64)
    # Both kinds of row in one file: chats, and verl-schema task rows ("12+7=" -> "19").
    task_rows = generate("arithmetic", num_train, seed=0, split="train")
    train = [{"messages": m} for m in CHATS] * 4 + task_rows
    val = generate("arithmetic", num_val, seed=0, split="test")
    overrides = [
        f"trainer.output_dir={out / 'run'}",
        "data.task=",  # no generated task: the files below
        f"data.train_files=[{write_jsonl(train, out / 'train.jsonl')}]",
        f"data.val_files=[{write_jsonl(val, out / 'val.jsonl')}]",
        "sft.max_length=96",  # tokens per chat; longer ones are an error (sft.truncation)
    ]
    if args.smoke:
        overrides += [
            "trainer.total_steps=2",
            "data.train_batch_size=8",
            "trainer.test_freq=2",
            "trainer.save_freq=0",
            "trainer.val_before_train=false",
        ]
    config = load_config("sft_demo", [*overrides, *args.set])
    summary = run_sft(config)
    print({k: summary.get(k) for k in ("steps", "first_val_loss", "last_val_loss", "hf_model")})

    # The exported model is a plain Hugging Face one: answer a held-out prompt greedily.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(summary["hf_model"])
    model = AutoModelForCausalLM.from_pretrained(summary["hf_model"])
    prompt = val[0]["prompt"]
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    answer = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    print(
        f"{prompt[-1]['content']!r} -> {tokenizer.decode(answer, skip_special_tokens=True)!r} "
        f"(ground truth {val[0]['reward_model']['ground_truth']!r})"
    )


if __name__ == "__main__":
    main()
