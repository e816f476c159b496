"""The JSON lines a kernel check module prints when run under Triton's CPU interpreter (the unit tests
run these modules as subprocesses, tests/unit/test_decode_attention.py): one line per comparison."""

from __future__ import annotations

import json
from typing import Callable, Sequence

import torch


def print_gaps(compare: Callable[..., object], cases: Sequence[tuple], where: str) -> None:
    """`compare(where, dtype, *case)` for float32 and bf16 over `cases`, then each case through the TMA
    kernel in float32 (`tma=True`: the interpreter's dots are exact in float32 only)."""
    for dt in (torch.float32, torch.bfloat16):
        for case in cases:
            print(json.dumps({"dtype": str(dt).removeprefix("torch."), "gaps": compare(where, dt, *case)}))
    for case in cases:
        print(json.dumps({"dtype": "float32", "tma": True, "gaps": compare(where, torch.float32, *case, tma=True)}))
