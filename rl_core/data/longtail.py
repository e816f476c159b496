"""Long-tail tasks: answer lengths from a heavy-tailed law, spread as a reasoning task's are.
Owns: the offline generator of two such tasks' data files; `n` is log-uniform on
[min_len, max_len] (`n = round(min_len * (max_len / min_len) ** u)`, `u` uniform on [0, 1)).
- `repeat` (the shipped `data/repeat/`, recipes/gpu-repeat.yaml): `{"id": 7, "prompt":
  "repeat:4x12=", "answer": "444444444444", "length": 12}`, the digit `d` written `n` times.
  With the defaults 2 and 1,100 the training file's completions are p50 49, p99 1,015, max 1,099
  digits (p99/p50 about 21); one token per digit plus the end token.
- `copy`: `{"prompt": "copy:0931=", "answer": "0931"}`, a random digit string written again. A
  116 M-parameter model's warm-up did not learn it in 400 steps (docs/benchmarks.md); not shipped.
Both are scored by the `addition` environment (exact string + end token, partial credit per
digit right by position). Files written atomically; `python -m rl_core.data.longtail
data/repeat` writes the shipped files. Does not own: reading the files (`dataset.py`), scoring (`rl_core.envs.addition`).
Read more: docs/examples.md, "The long-tail repeat task".
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

from rl_core.data.addition import TRAIN_FILE, VAL_FILE, to_jsonl
from rl_core.fsutil import atomic_write_text

KINDS = ("repeat", "copy")


def sample_length(rng: random.Random, min_len: int, max_len: int) -> int:
    """One log-uniform length in [min_len, max_len]."""
    return max(min_len, min(max_len, round(min_len * (max_len / min_len) ** rng.random())))


def make_example(idx: int, kind: str, rng: random.Random, n: int) -> dict[str, Any]:
    """One example of `kind` with an answer of `n` digits, keys in the order they are written."""
    if kind == "repeat":
        d = rng.choice("0123456789")
        return {"id": idx, "prompt": f"repeat:{d}x{n}=", "answer": d * n, "length": n}
    if kind == "copy":
        digits = "".join(rng.choice("0123456789") for _ in range(n))
        return {"id": idx, "prompt": f"copy:{digits}=", "answer": digits, "length": n}
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def longtail_examples(num: int, kind: str = "repeat", min_len: int = 2, max_len: int = 1100,
                      seed: int = 0) -> list[dict[str, Any]]:
    """`num` examples with ids 0..num-1, drawn with `random.Random(seed)`."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len {min_len}, max_len {max_len}")
    rng = random.Random(seed)
    return [make_example(i, kind, rng, sample_length(rng, min_len, max_len)) for i in range(num)]


def make_longtail_data(out_dir: str | Path, kind: str = "repeat", num_train: int = 2000, num_val: int = 200,
                       min_len: int = 2, max_len: int = 1100, seed: int = 0) -> dict[str, Any]:
    """Write `train.jsonl` and `val.jsonl` (the first `num_val` examples held out); returns a
    summary with the completion-length percentiles of the training file."""
    if num_train < 1 or num_val < 1:
        raise ValueError(f"need at least one training and one held-out example, got {num_train} and {num_val}")
    examples = longtail_examples(num_train + num_val, kind, min_len, max_len, seed)
    val, train = examples[:num_val], examples[num_val:]
    out = Path(out_dir)
    atomic_write_text(out / VAL_FILE, to_jsonl(val))
    atomic_write_text(out / TRAIN_FILE, to_jsonl(train))
    lengths = sorted(ex["length"] for ex in train)
    pct = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))]  # noqa: E731
    return {"train_file": str(out / TRAIN_FILE), "val_file": str(out / VAL_FILE), "num_train": len(train),
            "num_val": len(val), "p50": pct(0.5), "p99": pct(0.99), "max": lengths[-1], "seed": seed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rl_core.data.longtail",
                                     description="Write train.jsonl / val.jsonl of a long-tail task.")
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument("--kind", choices=KINDS, default="repeat")
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-val", type=int, default=200)
    parser.add_argument("--min-len", type=int, default=2, help="shortest answer in digits (default 2)")
    parser.add_argument("--max-len", type=int, default=1100, help="longest answer in digits (default 1100)")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    s = make_longtail_data(a.out_dir, a.kind, a.num_train, a.num_val, a.min_len, a.max_len, a.seed)
    print(f"wrote {s['num_train']} training and {s['num_val']} held-out examples (completion digits p50 {s['p50']}, "
          f"p99 {s['p99']}, max {s['max']}): {s['train_file']}, {s['val_file']}")


if __name__ == "__main__":
    main()
