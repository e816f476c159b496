"""The verifiable toy task: multi-digit addition with the answer's digits reversed.

Owns: the offline generator of the task's data files. Every pair (a, b) of `num_digits`-digit
numbers becomes one example, `{"id": 745, "prompt": "07+45=", "answer": "250", "a": 7,
"b": 45}`: the sum with `num_digits + 1` digits, reversed (the least significant digit first,
the order a carry is computed, which a tiny transformer learns far faster); `id` is
`a * 10**num_digits + b` whatever the seed. The pairs are shuffled with `random.Random(seed)`,
the first `num_val` held out, each file in that order (any prefix of `val.jsonl` is a fair
sample) and written atomically. The shipped `data/addition/` is what
`python -m rl_core.data.addition data/addition` writes (a unit test compares the bytes).

Does not own: reading the files back or ordering prompts (`dataset.py`), scoring
(`rl_core.envs.addition`) or tokenization (`rl_core.model`). Read more: docs/examples.md.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from rl_core.fsutil import atomic_write_text

TRAIN_FILE = "train.jsonl"
VAL_FILE = "val.jsonl"

# The largest operand width we generate: 10**(2*n) pairs are materialised in memory.
MAX_DIGITS = 3


def format_prompt(a: int, b: int, num_digits: int) -> str:
    """The prompt text of one pair: zero-padded operands, `+`, `=` (e.g. "07+45=")."""
    return f"{a:0{num_digits}d}+{b:0{num_digits}d}="


def format_answer(total: int, num_digits: int) -> str:
    """The expected completion: the sum as `num_digits + 1` digits, reversed (52 -> "250")."""
    width = num_digits + 1
    if not 0 <= total < 10**width:
        raise ValueError(f"sum {total} does not fit in {width} digits")
    return f"{total:0{width}d}"[::-1]


def parse_answer(text: str) -> int | None:
    """Inverse of `format_answer`: the integer a reversed-digit answer stands for, or None
    when the text is not a non-empty run of ASCII digits."""
    if not text or not (text.isascii() and text.isdigit()):
        return None
    return int(text[::-1])


def make_example(a: int, b: int, num_digits: int) -> dict[str, Any]:
    """One example record, keys in the order they are written."""
    return {
        "id": a * 10**num_digits + b,
        "prompt": format_prompt(a, b, num_digits),
        "answer": format_answer(a + b, num_digits),
        "a": a,
        "b": b,
    }


def all_examples(num_digits: int = 2) -> list[dict[str, Any]]:
    """Every pair of `num_digits`-digit operands, in id order."""
    _check_digits(num_digits)
    n = 10**num_digits
    return [make_example(a, b, num_digits) for a in range(n) for b in range(n)]


def split_examples(examples: list[dict[str, Any]], num_val: int, seed: int = 0
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Shuffle with `random.Random(seed)` and cut: (train, val), val = the first `num_val`."""
    if not 0 < num_val < len(examples):
        raise ValueError(f"num_val must be between 1 and {len(examples) - 1} for {len(examples)} "
                         f"examples, got {num_val}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    val = [examples[i] for i in order[:num_val]]
    train = [examples[i] for i in order[num_val:]]
    return train, val


def refuse_other_content(out: Path, name: str, expected: str) -> None:
    """`make-data` never overwrites data it did not write: an existing `out/name` must hold
    exactly `expected` (else an ArgumentError naming --out and the fix, --force)."""
    from rl_core.errors import ArgumentError

    f = out / name
    try:
        same = not f.exists() or (not f.is_dir() and f.read_text() == expected)
    except (OSError, UnicodeDecodeError):
        same = False
    if not same:
        raise ArgumentError("--out", str(out), f"a directory without a {name} that holds other data",
                            f"{f} exists with different content; choose another --out, or pass --force to "
                            "overwrite it.", "make-data")


def to_jsonl(examples: list[dict[str, Any]]) -> str:
    """One compact JSON object per line (`", "` and `": "` separators), newline-terminated."""
    return "".join(json.dumps(ex) + "\n" for ex in examples)


def make_addition_data(out_dir: str | Path, num_digits: int = 2, num_val: int = 1000,
                       seed: int = 0) -> dict[str, Any]:
    """Write `train.jsonl` and `val.jsonl` of the addition task into `out_dir`.

    Each file is written atomically; the two are written one after the other, validation
    first, so an interrupted call leaves at worst an old `train.jsonl` beside a new
    `val.jsonl` (rerun to fix). Returns a summary: paths and sizes.
    """
    out = Path(out_dir)
    train, val = split_examples(all_examples(num_digits), num_val, seed)
    val_path, train_path = out / VAL_FILE, out / TRAIN_FILE
    atomic_write_text(val_path, to_jsonl(val))
    atomic_write_text(train_path, to_jsonl(train))
    return {
        "train_file": str(train_path),
        "val_file": str(val_path),
        "num_train": len(train),
        "num_val": len(val),
        "num_digits": num_digits,
        "seed": seed,
    }


def check_make_data_args(out_dir: str | Path, num_val: int, seed: int = 0, num_digits: int = 2,
                         force: bool = False) -> None:
    """`rl-core make-data`'s checks, before anything is written: `--num-val` leaves both files
    non-empty, `--out` is a directory (or missing), and its train/val files are either absent,
    identical to what would be written, or `force` is given (a user's data is not overwritten unasked)."""
    from rl_core.errors import ArgumentError

    total = 10 ** (2 * num_digits)
    if not 0 < num_val < total:
        raise ArgumentError("--num-val", num_val, f"an integer from 1 to {total - 1} (the task has {total} pairs of "
                            f"{num_digits}-digit numbers; the rest become the training set)",
                            f"pass e.g. --num-val 1000.", "make-data")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ArgumentError("--out", str(out), "a directory to write train.jsonl and val.jsonl into (created if missing)",
                            f"{out} is a file; choose another --out (rl_core does not overwrite it).", "make-data")
    if force:
        return
    for name in (TRAIN_FILE, VAL_FILE):
        f = out / name
        if f.is_dir():
            raise ArgumentError("--out", str(out), f"a directory whose {name} is a file or missing",
                                f"{f} is a directory; choose another --out.", "make-data")
        if f.exists():
            refuse_other_content(out, name, to_jsonl(split_examples(all_examples(num_digits), num_val, seed)[name == VAL_FILE]))


def _check_digits(num_digits: int) -> None:
    if not 1 <= num_digits <= MAX_DIGITS:
        raise ValueError(f"num_digits must be between 1 and {MAX_DIGITS}, got {num_digits} "
                         f"({10 ** (2 * num_digits):,} pairs would be generated)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rl_core.data.addition",
        description="Write train.jsonl / val.jsonl of the reversed-digit addition task.")
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument("--num-digits", type=int, default=2, help="digits per operand (default 2)")
    parser.add_argument("--num-val", type=int, default=1000, help="held-out pairs (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split (default 0)")
    args = parser.parse_args(argv)
    summary = make_addition_data(args.out_dir, args.num_digits, args.num_val, args.seed)
    print(f"wrote {summary['num_train']} training and {summary['num_val']} validation examples: "
          f"{summary['train_file']}, {summary['val_file']}")


if __name__ == "__main__":
    main()
