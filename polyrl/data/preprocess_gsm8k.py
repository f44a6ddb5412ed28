"""Convert local GSM8K-format files (``question`` / ``answer`` with ``#### N``) into schema rows.

Command line::

    python -m polyrl.data.preprocess_gsm8k --input train.jsonl --test-input test.jsonl --out DIR
    python -m polyrl.data.preprocess_gsm8k --input all.parquet --test-fraction 0.1 --out DIR

Writes ``DIR/train.parquet`` and ``DIR/test.parquet``.  Without ``--test-input`` a seeded random
``--test-fraction`` of the input becomes the test split.  Nothing is downloaded: point
``--input`` at files you already have.  A 20-row sample in this format ships with polyrl
(:func:`sample_gsm8k_path`).
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from polyrl.data.io import read_rows, write_rows
from polyrl.data.schema import make_row

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SAMPLE_FILE = "gsm8k_sample.jsonl"

_FINAL_ANSWER = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def sample_gsm8k_path() -> Path:
    """Path of the 20-row GSM8K-format sample shipped in ``polyrl/data/files``."""
    path = Path(str(resources.files("polyrl.data").joinpath("files", SAMPLE_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"shipped GSM8K sample is missing: {path}")
    return path


def extract_gsm8k_answer(answer: str) -> str:
    """Return the number after the last ``####`` of a GSM8K answer, without thousands commas.

    Raises:
        ValueError: If there is no ``#### <number>`` in ``answer``.
    """
    if not isinstance(answer, str):
        raise TypeError(f"answer must be a string, got {type(answer).__name__}")
    matches = _FINAL_ANSWER.findall(answer)
    if not matches:
        tail = answer[-80:]
        raise ValueError(f"answer has no final '#### <number>' line (ends with {tail!r})")
    return matches[-1].replace(",", "")


def convert_gsm8k_rows(rows: Iterable[Mapping[str, Any]], split: str) -> list[dict[str, Any]]:
    """Turn GSM8K-format records into schema rows for ``split``.

    The user message is the question followed by :data:`INSTRUCTION`; ground truth is the
    final number; ``extra_info`` keeps the split, the index within the split, and the original
    question and worked answer.

    Raises:
        ValueError: Naming the record that lacks a string ``question``/``answer`` or whose
            answer has no ``#### N``.
    """
    out = []
    for i, rec in enumerate(rows):
        for field in ("question", "answer"):
            if not isinstance(rec.get(field), str):
                raise ValueError(
                    f"GSM8K record {i} needs a string {field!r} field; it has {sorted(rec)}"
                )
        question, answer = rec["question"].strip(), rec["answer"]
        try:
            ground_truth = extract_gsm8k_answer(answer)
        except ValueError as err:
            raise ValueError(f"GSM8K record {i}: {err}") from err
        out.append(
            make_row(
                DATA_SOURCE,
                f"{question} {INSTRUCTION}",
                ground_truth,
                ability="math",
                extra_info={"split": split, "index": i, "question": question, "answer": answer},
            )
        )
    return out


def write_gsm8k_splits(
    input_path: str | Path,
    out_dir: str | Path,
    test_input: str | Path | None = None,
    test_fraction: float = 0.1,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Convert GSM8K-format file(s) and write ``train.parquet`` / ``test.parquet``.

    Args:
        input_path: ``.jsonl`` / ``.json`` / ``.parquet`` file of ``question``/``answer`` records.
        out_dir: Output folder (created).
        test_input: Optional file for the test split; when given, all of ``input_path`` is train.
        test_fraction: Without ``test_input``, the share of records (seeded random choice, order
            kept) that goes to the test split.
        seed: Seed of that choice.

    Returns:
        ``(train_path, test_path)``.
    """
    records = read_rows(input_path)
    if test_input is not None:
        train_records, test_records = records, read_rows(test_input)
    else:
        if not 0.0 <= test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
        num_test = round(len(records) * test_fraction)
        chosen = set(random.Random(seed).sample(range(len(records)), num_test))
        train_records = [r for i, r in enumerate(records) if i not in chosen]
        test_records = [r for i, r in enumerate(records) if i in chosen]
    out = Path(out_dir)
    train_path = write_rows(convert_gsm8k_rows(train_records, "train"), out / "train.parquet")
    test_path = write_rows(convert_gsm8k_rows(test_records, "test"), out / "test.parquet")
    return train_path, test_path


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; prints the two written paths."""
    parser = argparse.ArgumentParser(
        prog="python -m polyrl.data.preprocess_gsm8k",
        description="Convert local GSM8K-format files into polyrl train/test parquet files.",
    )
    parser.add_argument("--input", required=True, type=Path, help=".jsonl/.json/.parquet file")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--test-input", type=Path, default=None, help="separate test file")
    parser.add_argument("--test-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        train, test = write_gsm8k_splits(
            args.input, args.out, args.test_input, args.test_fraction, args.seed
        )
    except (OSError, TypeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(train)
    print(test)
    return 0


if __name__ == "__main__":
    sys.exit(main())
