"""Small-number arithmetic for a pretrained chat model (the SmolLM2 recipe's task).

Owns: the offline generator of `data/arithmetic/{train,val}.jsonl`. Every triple of operands
`a`, `b` in `min_operand..max_operand` and an operator of `ops` (`+`, `-`, `*`) becomes one
example, `{"id": 23, "prompt": "3 + 4", "answer": "7", "a": 3, "b": 4, "op": "+"}`: the bare
expression (the reply's format is the environment's: `env.system_prompt` /
`env.instruction`), the exact result as a decimal integer, `id` the index in generation order
whatever the seed. The split is shuffled with `random.Random(seed)`, the first `num_val`
held out, files written atomically; the shipped files are `rl-core make-data arithmetic`'s
(a unit test compares the bytes).

Does not own: scoring (`rl_core.envs.math`, answer_format `number_only` in the recipe),
reading the files back (`dataset.py`). Read more: docs/examples.md (SmolLM2 arithmetic).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rl_core.fsutil import atomic_write_text
from rl_core.data.addition import TRAIN_FILE, VAL_FILE, to_jsonl

DEFAULT_OPS = "+"
DEFAULT_MIN, DEFAULT_MAX = 1, 9
DEFAULT_NUM_VAL = 32
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
MAX_EXAMPLES = 1_000_000


def all_examples(min_operand: int = DEFAULT_MIN, max_operand: int = DEFAULT_MAX, ops: str = DEFAULT_OPS
                 ) -> list[dict[str, Any]]:
    """Every (op, a, b) example, in id order."""
    check_args(min_operand, max_operand, ops, 1)
    out = []
    for op in ops:
        for a in range(min_operand, max_operand + 1):
            for b in range(min_operand, max_operand + 1):
                out.append({"id": len(out), "prompt": f"{a} {op} {b}", "answer": str(OPS[op](a, b)),
                            "a": a, "b": b, "op": op})
    return out


def split(examples: list[dict[str, Any]], num_val: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, val): shuffled with `random.Random(seed)`, val = the first `num_val`."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    return [examples[i] for i in order[num_val:]], [examples[i] for i in order[:num_val]]


def check_args(min_operand: int, max_operand: int, ops: str, num_val: int) -> None:
    """Raise `ArgumentError` (naming the `rl-core make-data` flag) for arguments that make no data set."""
    from rl_core.errors import ArgumentError

    if not ops or any(op not in OPS for op in ops) or len(set(ops)) != len(ops):
        raise ArgumentError("--ops", ops, f"distinct operators from {''.join(OPS)} (e.g. '+' or '+-*')",
                            "pass e.g. --ops +-.", "make-data")
    if min_operand < 0 or max_operand < min_operand:
        raise ArgumentError("--max-operand", max_operand, f"an integer >= --min-operand ({min_operand}), which is >= 0",
                            "pass e.g. --min-operand 1 --max-operand 9.", "make-data")
    total = len(ops) * (max_operand - min_operand + 1) ** 2
    if total > MAX_EXAMPLES:
        raise ArgumentError("--max-operand", max_operand, f"a range giving at most {MAX_EXAMPLES:,} examples "
                            f"(got {total:,})", "lower --max-operand.", "make-data")
    if not 0 < num_val < total:
        raise ArgumentError("--num-val", num_val, f"an integer from 1 to {total - 1} (the task has {total} examples; "
                            "the rest become the training set)", f"pass e.g. --num-val {min(DEFAULT_NUM_VAL, total - 1)}.",
                            "make-data")


def make_arithmetic_data(out_dir: str | Path, num_val: int = DEFAULT_NUM_VAL, seed: int = 0,
                         min_operand: int = DEFAULT_MIN, max_operand: int = DEFAULT_MAX,
                         ops: str = DEFAULT_OPS) -> dict[str, Any]:
    """Write `val.jsonl` then `train.jsonl` into `out_dir` (atomically); returns a summary."""
    check_args(min_operand, max_operand, ops, num_val)
    train, val = split(all_examples(min_operand, max_operand, ops), num_val, seed)
    out = Path(out_dir)
    atomic_write_text(out / VAL_FILE, to_jsonl(val))
    atomic_write_text(out / TRAIN_FILE, to_jsonl(train))
    return {"train_file": str(out / TRAIN_FILE), "val_file": str(out / VAL_FILE), "num_train": len(train),
            "num_val": len(val)}


def expected_files(num_val: int = DEFAULT_NUM_VAL, seed: int = 0, min_operand: int = DEFAULT_MIN,
                   max_operand: int = DEFAULT_MAX, ops: str = DEFAULT_OPS) -> dict[str, str]:
    """File name -> the text `make_arithmetic_data` would write (for the overwrite check)."""
    train, val = split(all_examples(min_operand, max_operand, ops), num_val, seed)
    return {TRAIN_FILE: to_jsonl(train), VAL_FILE: to_jsonl(val)}
