"""Prompt datasets: reading JSON-lines files and the epoch-bounded prompt source.

Owns:
- `load_jsonl` / `iter_jsonl` / `count_jsonl`: one example (a JSON object) per line, with a
  `DataError` that names the file and the line for a line over `MAX_LINE_BYTES` (1 MiB), bytes
  that are not UTF-8, malformed JSON, a line that is not an object, a missing key, a known key
  of the wrong type (`prompt` and `answer` are strings), or a file without examples. Blank
  lines are skipped. `rl-core validate` runs the same checks over every line.
- `PromptSource`: the seeded, resumable iterator the controller's rollout pump draws
  prompts from, one RL step's worth (`batch_size = grpo.num_prompts_per_step`) at a time.

`PromptSource` semantics (the controller and checkpoints rely on them):
- An *epoch* is one pass over the examples. With `shuffle`, the order of epoch `e` is a
  permutation that depends only on `(seed, e)`, so any epoch can be recomputed on resume
  without replaying the ones before it; without `shuffle` it is file order.
- `drop_last`: an epoch yields `len(examples) // batch_size` full batches; the examples
  left over at the end of the permutation are skipped for that epoch (a later epoch's
  permutation puts other examples there).
- `epoch` is the epoch the *next* batch comes from, `position` the number of batches
  already drawn from it: after the last batch of epoch 0, `epoch == 1, position == 0`.
- `next_batch()` returns `None` once `max_num_epochs` epochs are drawn (and keeps
  returning `None`); with `max_num_epochs=None` it never runs out.
- `state_dict()` is a few plain ints; a fresh source over the same examples with the same
  batch size and seed, after `load_state_dict`, yields exactly the batches the saved one
  would have yielded next.

Does not own: generating the task files (`addition.py`), turning examples into tokens
(environments), or deciding when a drawn prompt trains (samplers, the buffer).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Sequence

from rl_core.errors import DataError, RecipeError


MAX_LINE_BYTES = 1 << 20
"""Longest line (one example) read from a data file: 1 MiB. A prompt longer than any model's
context is a broken file (a missing newline, a binary file), and reading it must fail fast."""

FIELD_TYPES: dict[str, tuple[type, ...]] = {"prompt": (str,), "answer": (str,), "a": (int,), "b": (int,), "id": (int, str)}
"""Types of the known example keys (`prompt` and `answer` are text: an answer such as `052`
is compared as a string; `a`, `b` are the operands chain_addition reads). Other keys are free."""

_TYPE_NAMES = {str: "a string", int: "an integer"}


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", bool: "a boolean", type(None): "null", str: "a string",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def iter_jsonl(path: str | Path, required_keys: Sequence[str] = ("prompt", "answer")) -> Iterator[dict[str, Any]]:
    """Stream the examples of a JSON-lines file, checking every line (see `load_jsonl`)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file {p} does not exist (or is not a file); check data.train_file / "
                        f"data.val_file, or generate the addition task with "
                        f"`rl-core make-data addition`.")
    found = False
    try:
        fh = open(p, "rb")
    except OSError as exc:
        raise DataError(f"data file {p} cannot be read ({exc.strerror}); check its permissions.") from None
    with fh:
        lineno = 0
        while True:
            raw = fh.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            lineno += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise DataError(f"{p}, line {lineno}: longer than {MAX_LINE_BYTES:,} bytes (the data line-size "
                                f"limit); each line must be one example, e.g. "
                                f'{{"prompt": "07+45=", "answer": "250"}} (is this a data file? is a newline missing?).')
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{p}, line {lineno}: not UTF-8 (byte {raw[exc.start:exc.start + 1]!r} at column "
                                f"{exc.start + 1}); data files must be UTF-8 JSON lines: re-encode the file.") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{p}, line {lineno}: malformed JSON ({exc.msg} at column {exc.colno}); "
                                f"each line must be one JSON object.") from None
            except RecursionError:
                raise DataError(f"{p}, line {lineno}: JSON nested too deeply; each line must be one flat "
                                f"JSON object such as {{\"prompt\": \"07+45=\", \"answer\": \"250\"}}.") from None
            if not isinstance(record, dict):
                raise DataError(f"{p}, line {lineno}: expected a JSON object, got {type(record).__name__}; "
                                f"each line must be one JSON object such as "
                                f'{{"prompt": "07+45=", "answer": "250"}}.')
            missing = [k for k in required_keys if k not in record]
            if missing:
                raise DataError(f"{p}, line {lineno}: missing key(s) {', '.join(map(repr, missing))}; "
                                f"every example needs {', '.join(map(repr, required_keys))} "
                                f"(found {', '.join(map(repr, record)) or 'no keys'}).")
            for key, types in FIELD_TYPES.items():
                if key in record and (not isinstance(record[key], types) or isinstance(record[key], bool)):
                    want = " or ".join(_TYPE_NAMES[t] for t in types)
                    raise DataError(f"{p}, line {lineno}: field {key!r} got {_type_name(record[key])} "
                                    f"({json.dumps(record[key])[:60]}); expected {want}. Fix the data "
                                    f"(e.g. \"{key}\": " + ('"250"' if str in types else "25") + ").")
            found = True
            yield record
    if not found:
        raise DataError(f"{p} holds no examples (the file is empty or blank); "
                        f"it needs one JSON object per line.")


def load_jsonl(path: str | Path, required_keys: Sequence[str] = ("prompt", "answer")) -> list[dict[str, Any]]:
    """Read a JSON-lines file of examples; every line must be a UTF-8 JSON object of at most
    `MAX_LINE_BYTES` with `required_keys`, and known keys must have their `FIELD_TYPES`."""
    return list(iter_jsonl(path, required_keys))


def count_jsonl(path: str | Path, required_keys: Sequence[str] = ("prompt", "answer")) -> int:
    """Check every line of a data file (as `load_jsonl`) without keeping it; the number of examples."""
    return sum(1 for _ in iter_jsonl(path, required_keys))


def load_task_data(train_file: str | Path, val_file: str | Path,
                   required_keys: Sequence[str] = ("prompt", "answer")
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Both files of a task: (train, val)."""
    return load_jsonl(train_file, required_keys), load_jsonl(val_file, required_keys)


class PromptDraw(NamedTuple):
    """One drawn prompt: its index in the examples, the epoch it was drawn in, the example."""

    index: int
    epoch: int
    example: dict[str, Any]


class PromptSource:
    """Epoch-bounded, seeded, resumable batches of prompts (see the module docstring)."""

    def __init__(self, examples: Sequence[dict[str, Any]], batch_size: int, shuffle: bool = True,
                 seed: int = 0, max_num_epochs: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_num_epochs is not None and max_num_epochs < 1:
            raise ValueError(f"max_num_epochs must be >= 1 or None, got {max_num_epochs}")
        if len(examples) < batch_size:
            raise RecipeError.single(
                "grpo.num_prompts_per_step", batch_size,
                f"at most the number of training examples ({len(examples)})",
                "lower grpo.num_prompts_per_step or use a larger data.train_file.")
        self._examples = list(examples)
        self._batch_size = int(batch_size)
        self._shuffle = bool(shuffle)
        self._seed = int(seed)
        self._max_num_epochs = max_num_epochs
        self._epoch = 0
        self._position = 0
        self._order_epoch: int | None = None
        self._order: list[int] = []

    # ------------------------------------------------------------------ properties

    @property
    def num_examples(self) -> int:
        return len(self._examples)

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def max_num_epochs(self) -> int | None:
        return self._max_num_epochs

    @property
    def batches_per_epoch(self) -> int:
        """Full batches in one epoch (an incomplete final batch is dropped)."""
        return len(self._examples) // self._batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based); equals the number of finished epochs."""
        return self._epoch

    @property
    def position(self) -> int:
        """Batches already drawn from the current epoch (0 .. batches_per_epoch - 1)."""
        return self._position

    @property
    def num_batches_drawn(self) -> int:
        """Batches drawn since the start of the run (over all epochs)."""
        return self._epoch * self.batches_per_epoch + self._position

    @property
    def exhausted(self) -> bool:
        """True when the epoch bound is reached: `next_batch()` returns None."""
        return self._max_num_epochs is not None and self._epoch >= self._max_num_epochs

    def total_steps(self, max_num_steps: int) -> int:
        """RL steps the run will take: `max_num_steps`, capped by the epoch bound if any."""
        if self._max_num_epochs is None:
            return max_num_steps
        return min(max_num_steps, self._max_num_epochs * self.batches_per_epoch)

    # ------------------------------------------------------------------ drawing

    def epoch_order(self, epoch: int) -> list[int]:
        """Example indices in the order epoch `epoch` visits them (a function of seed and epoch only)."""
        order = list(range(len(self._examples)))
        if self._shuffle:
            random.Random(f"rl_core.PromptSource:{self._seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[PromptDraw] | None:
        """The next `batch_size` prompts, or None once `max_num_epochs` epochs are drawn."""
        if self.exhausted:
            return None
        if self._order_epoch != self._epoch:
            self._order = self.epoch_order(self._epoch)
            self._order_epoch = self._epoch
        start = self._position * self._batch_size
        indices = self._order[start:start + self._batch_size]
        assert len(indices) == self._batch_size, "drop_last bookkeeping broke"
        batch = [PromptDraw(i, self._epoch, self._examples[i]) for i in indices]
        self._position += 1
        if self._position >= self.batches_per_epoch:
            self._epoch += 1
            self._position = 0
        return batch

    def __iter__(self) -> Iterator[list[PromptDraw]]:
        """Batches until the epoch bound (forever when unbounded)."""
        while (batch := self.next_batch()) is not None:
            yield batch

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, int]:
        """Plain ints: where the source stands, plus what it must be restored onto."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self._seed,
            "shuffle": int(self._shuffle),
            "batch_size": self._batch_size,
            "num_examples": len(self._examples),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a `state_dict()`; the examples, batch size, seed and shuffle must match."""
        expected = {"seed": self._seed, "shuffle": int(self._shuffle), "batch_size": self._batch_size,
                    "num_examples": len(self._examples)}
        fixes = {"seed": "grpo.seed", "shuffle": "data.shuffle", "batch_size": "grpo.num_prompts_per_step",
                 "num_examples": "data.train_file"}
        for key, value in expected.items():
            if key in state and int(state[key]) != value:
                raise DataError(
                    f"cannot resume the prompt source: the checkpoint was taken with {key}={state[key]} "
                    f"but this run has {key}={value}; restore {fixes[key]} to the checkpoint's value "
                    f"(a resumed run must draw from the same prompt order).")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.batches_per_epoch:
            raise DataError(f"cannot resume the prompt source: epoch={epoch}, position={position} is out of "
                            f"range (0 <= position < {self.batches_per_epoch}).")
        self._epoch, self._position = epoch, position
