"""The long-tail task: copy a digit string whose length is drawn from a heavy-tailed law.

Owns: the offline generator of the task's data files. Each example is a string of `n` random
digits, `{"id": 7, "prompt": "copy:0931=", "answer": "0931", "length": 4}`; the completion is
the string again (every digit is one token of the tiny tokenizer, so `n` tokens plus the end
token). `n` is log-uniform on [min_len, max_len] (`n = round(min_len * (max_len / min_len) **
u)`, `u` uniform on [0, 1)): with the defaults 2 and 1,100 the shipped training file's median
completion is 47 digits, its 99th percentile 1,026 and its longest 1,099 (p99/p50 about 22), the
spread that makes a synchronous RL step wait on its longest sample. Scored by the `addition`
environment (exact string + end token, partial credit per digit right by position). Written
atomically; `python -m rl_core.data.copying data/copy` writes the shipped `data/copy/`.

Does not own: reading the files (`dataset.py`), scoring (`rl_core.envs.addition`).
Read more: docs/examples.md, "The long-tail copy task".
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

from rl_core.data.addition import TRAIN_FILE, VAL_FILE, to_jsonl
from rl_core.fsutil import atomic_write_text

PREFIX = "copy:"


def sample_length(rng: random.Random, min_len: int, max_len: int) -> int:
    """One log-uniform length in [min_len, max_len]."""
    return max(min_len, min(max_len, round(min_len * (max_len / min_len) ** rng.random())))


def make_example(idx: int, digits: str) -> dict[str, Any]:
    """One example record, keys in the order they are written."""
    return {"id": idx, "prompt": f"{PREFIX}{digits}=", "answer": digits, "length": len(digits)}


def copy_examples(num: int, min_len: int = 2, max_len: int = 1100, seed: int = 0) -> list[dict[str, Any]]:
    """`num` examples with ids 0..num-1, drawn with `random.Random(seed)`."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len {min_len}, max_len {max_len}")
    rng = random.Random(seed)
    out = []
    for i in range(num):
        n = sample_length(rng, min_len, max_len)
        out.append(make_example(i, "".join(rng.choice("0123456789") for _ in range(n))))
    return out


def make_copy_data(out_dir: str | Path, num_train: int = 2000, num_val: int = 200, min_len: int = 2,
                   max_len: int = 1100, seed: int = 0) -> dict[str, Any]:
    """Write `train.jsonl` and `val.jsonl` (the first `num_val` examples held out); returns a
    summary with the completion-length percentiles of the training file."""
    if num_train < 1 or num_val < 1:
        raise ValueError(f"need at least one training and one held-out example, got {num_train} and {num_val}")
    examples = copy_examples(num_train + num_val, min_len, max_len, seed)
    val, train = examples[:num_val], examples[num_val:]
    out = Path(out_dir)
    atomic_write_text(out / VAL_FILE, to_jsonl(val))
    atomic_write_text(out / TRAIN_FILE, to_jsonl(train))
    lengths = sorted(ex["length"] for ex in train)
    pct = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))]  # noqa: E731
    return {"train_file": str(out / TRAIN_FILE), "val_file": str(out / VAL_FILE), "num_train": len(train),
            "num_val": len(val), "p50": pct(0.5), "p99": pct(0.99), "max": lengths[-1], "seed": seed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rl_core.data.copying",
                                     description="Write train.jsonl / val.jsonl of the long-tail copy task.")
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-val", type=int, default=200)
    parser.add_argument("--min-len", type=int, default=2, help="shortest digit string (default 2)")
    parser.add_argument("--max-len", type=int, default=1100, help="longest digit string (default 1100)")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    s = make_copy_data(a.out_dir, a.num_train, a.num_val, a.min_len, a.max_len, a.seed)
    print(f"wrote {s['num_train']} training and {s['num_val']} held-out examples (completion digits p50 {s['p50']}, "
          f"p99 {s['p99']}, max {s['max']}): {s['train_file']}, {s['val_file']}")


if __name__ == "__main__":
    main()
