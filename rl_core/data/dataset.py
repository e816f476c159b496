"""Prompt datasets: reading data files (JSON lines, Parquet, `save_to_disk` directories) and
the epoch-bounded prompt source.

Owns: `load_jsonl` / `iter_jsonl` / `count_jsonl` (one JSON object a line, at most
`MAX_LINE_BYTES`; a `DataError` names the file and line for bad UTF-8, bad JSON, a non-object,
a missing or mistyped key, an empty file); `load_examples` / `iter_examples` /
`count_examples` (any supported format with the recipe's field mapping, `Fields`; each row
checked like a JSON line, Parquet and saved datasets streamed in batches, plus the canonical
`prompt`, `answer`, `messages` keys); `count_rows` (from file metadata); and `PromptSource`,
the seeded, resumable iterator the rollout pump draws one RL step's prompts from (epoch e's
order depends only on (seed, e); full batches only; `None` after `max_num_epochs`).

Does not own: generating task files, turning examples into tokens (environments), or when
a drawn prompt trains (samplers, buffer). Read more: docs/environments.md, "Use a dataset".
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Sequence

from rl_core.errors import DataError, RecipeError


MAX_LINE_BYTES = 1 << 20
"""Longest line (one example) read from a data file: 1 MiB, in every format (a JSON line, a
Parquet or saved-dataset row as Arrow holds it). A prompt longer than any model's context is a
broken file (a missing newline, a binary file, a stray blob), and reading it must fail fast."""

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
    for where, record in _jsonl_records(p):
        _check_keys(record, where, required_keys)
        yield record


def _jsonl_records(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`"<file>, line N"`, object) for every non-blank line: size, UTF-8, JSON and object checks,
    plus the types of the known keys (FIELD_TYPES); a file without examples is an error."""
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
            found = True
            yield f"{p}, line {lineno}", record
    if not found:
        raise DataError(f"{p} holds no examples (the file is empty or blank); "
                        f"it needs one JSON object per line.")


def _check_keys(record: dict[str, Any], where: str, required_keys: Sequence[str],
                typed: dict[str, tuple[type, ...]] | None = None) -> None:
    """Required keys present; known keys (FIELD_TYPES, plus `typed`) of their types."""
    missing = [k for k in required_keys if k not in record]
    if missing:
        raise DataError(f"{where}: missing key(s) {', '.join(map(repr, missing))}; "
                        f"every example needs {', '.join(map(repr, required_keys))} "
                        f"(found {', '.join(map(repr, record)) or 'no keys'}).")
    for key, types in {**FIELD_TYPES, **(typed or {})}.items():
        if key in record and (not isinstance(record[key], types) or isinstance(record[key], bool)):
            want = " or ".join(_TYPE_NAMES[t] for t in types)
            raise DataError(f"{where}: field {key!r} got {_type_name(record[key])} "
                            f"({json.dumps(record[key], default=str)[:60]}); expected {want}. Fix the data "
                            f"(e.g. \"{key}\": " + ('"250"' if str in types else "25") + ").")


def load_jsonl(path: str | Path, required_keys: Sequence[str] = ("prompt", "answer")) -> list[dict[str, Any]]:
    """Read a JSON-lines file of examples; every line must be a UTF-8 JSON object of at most
    `MAX_LINE_BYTES` with `required_keys`, and known keys must have their `FIELD_TYPES`."""
    return list(iter_jsonl(path, required_keys))


def count_jsonl(path: str | Path, required_keys: Sequence[str] = ("prompt", "answer")) -> int:
    """Check every line of a data file (as `load_jsonl`) without keeping it; the number of examples."""
    return sum(1 for _ in iter_jsonl(path, required_keys))


def load_task_data(train_file: str | Path, val_file: str | Path,
                   required_keys: Sequence[str] = ("prompt", "answer"), fields: "Fields | None" = None,
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Both files of a task: (train, val). With `fields` (the recipe's mapping) any supported
    format is read (`load_examples`); without, JSON lines with `required_keys`."""
    if fields is not None:
        return load_examples(train_file, fields), load_examples(val_file, fields)
    return load_jsonl(train_file, required_keys), load_jsonl(val_file, required_keys)


# --------------------------------------------------------------------------- any format, mapped fields

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Fields:
    """The recipe's field mapping (`data.prompt_key`, `data.answer_key`, `data.messages_key`)."""

    prompt_key: str = "prompt"
    answer_key: str | None = "answer"
    messages_key: str | None = None

    @classmethod
    def of(cls, data_cfg: Any) -> "Fields":
        """The mapping of a recipe's `data` section (defaults for anything it lacks)."""
        return cls(prompt_key=getattr(data_cfg, "prompt_key", "prompt"),
                   answer_key=getattr(data_cfg, "answer_key", "answer"),
                   messages_key=getattr(data_cfg, "messages_key", None))

    @property
    def required(self) -> tuple[str, ...]:
        first = self.messages_key or self.prompt_key
        return (first,) + ((self.answer_key,) if self.answer_key else ())

    def to_example(self, record: dict[str, Any], where: str) -> dict[str, Any]:
        """Check one row and give it the canonical keys (`prompt`, `answer`, `messages`)."""
        typed: dict[str, tuple[type, ...]] = {}
        if not self.messages_key or self.prompt_key in record:
            typed[self.prompt_key] = (str,)
        if self.answer_key:
            typed[self.answer_key] = (str,)
        _check_keys(record, where, self.required, typed)
        example = dict(record)
        if self.prompt_key in record:
            example["prompt"] = record[self.prompt_key]
        if self.answer_key:
            example["answer"] = record[self.answer_key]
        if self.messages_key:
            example["messages"] = _check_messages(record[self.messages_key], where, self.messages_key)
        return example


def _check_messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    fix = (f"each row's {key!r} must be a list of chat messages such as "
           f'[{{"role": "user", "content": "What is 2 + 3?"}}] (roles: {", ".join(CHAT_ROLES)}).')
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {key!r} got {_type_name(value) if value != [] else 'an empty list'}; "
                        f"expected a non-empty list of messages. Fix the data: {fix}")
    out = []
    for i, msg in enumerate(value):
        ok = (isinstance(msg, dict) and isinstance(msg.get("role"), str) and msg["role"] in CHAT_ROLES
              and isinstance(msg.get("content"), str))
        if not ok:
            raise DataError(f"{where}: field {key!r}, message {i}: got {json.dumps(msg, default=str)[:80]}; "
                            f"expected an object with a string 'role' ({'/'.join(CHAT_ROLES)}) and a string "
                            f"'content'. Fix the data: {fix}")
        out.append({"role": msg["role"], "content": msg["content"]})
    return out


def data_format(path: str | Path) -> str:
    """"save_to_disk" for a directory, "parquet" for a `.parquet` file, else "jsonl"."""
    p = Path(path)
    if p.is_dir():
        return "save_to_disk"
    return "parquet" if p.suffix.lower() == ".parquet" else "jsonl"


def _parquet_records(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq

    if not p.is_file():
        raise DataError(f"data file {p} does not exist (or is not a file); check data.train_file / data.val_file.")
    try:
        pf = pq.ParquetFile(p)
    except Exception as exc:  # noqa: BLE001 - a foreign file: any parse failure is the file's fault
        raise DataError(f"{p}: not a readable Parquet file ({type(exc).__name__}: {exc}); "
                        f"write it with pandas/pyarrow/datasets `to_parquet`, or rename a JSON-lines file "
                        f"to end in .jsonl.") from None
    first = 1
    for k in range(pf.metadata.num_row_groups):  # from the footer, before any row is read
        group = pf.metadata.row_group(k)
        if group.num_rows and group.total_byte_size > (MAX_LINE_BYTES + 1024) * group.num_rows:
            raise DataError(f"{p}, rows {first}-{first + group.num_rows - 1}: {group.total_byte_size:,} bytes for "
                            f"{group.num_rows} row(s), so a row is longer than {MAX_LINE_BYTES:,} bytes (the data "
                            f"row-size limit); each row must be one example such as "
                            f'{{"prompt": "07+45=", "answer": "250"}}: shorten or drop the long rows.')
        first += group.num_rows
    yield from _arrow_records(p, pf.iter_batches(batch_size=ARROW_BATCH_ROWS), "the Parquet file has no rows")


ARROW_BATCH_ROWS = 256
"""Rows of a Parquet file or saved dataset converted to Python at a time (streamed reading)."""


def _arrow_records(p: Path, batches: Iterator[Any], empty: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The rows of Arrow record batches (or tables), each checked against `MAX_LINE_BYTES` in
    Arrow's memory before it becomes a Python object; a file without rows is an error."""
    row = 0
    for batch in batches:
        if batch.nbytes > MAX_LINE_BYTES:  # some row may be over the limit: measure each
            for i in range(batch.num_rows):
                size = batch.slice(i, 1).nbytes
                if size > MAX_LINE_BYTES:
                    raise DataError(f"{p}, row {row + i + 1}: {size:,} bytes, longer than {MAX_LINE_BYTES:,} bytes "
                                    f"(the data row-size limit); each row must be one example such as "
                                    f'{{"prompt": "07+45=", "answer": "250"}}: shorten or drop the long rows.')
        for record in batch.to_pylist():
            row += 1
            yield f"{p}, row {row}", record
    if row == 0:
        raise DataError(f"{p} holds no examples ({empty}).")


def _save_to_disk_records(p: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if (p / "dataset_dict.json").is_file():
        splits = sorted(d.name for d in p.iterdir() if (d / "state.json").is_file())
        raise DataError(f"{p} is a datasets DatasetDict (splits: {', '.join(splits) or 'none'}); point "
                        f"data.train_file / data.val_file at one split's directory, e.g. {p / (splits[0] if splits else 'train')}.")
    if not (p / "state.json").is_file():
        raise DataError(f"{p} is a directory but not one written by datasets.Dataset.save_to_disk (no state.json); "
                        f"point the data file at a .jsonl or .parquet file, or at a save_to_disk directory.")
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as exc:  # noqa: BLE001 - a foreign directory: any failure is the data's fault
        raise DataError(f"{p}: cannot be read by datasets.load_from_disk ({type(exc).__name__}: {exc}); "
                        f"write it again with Dataset.save_to_disk.") from None
    yield from _arrow_records(p, ds.with_format("arrow").iter(batch_size=ARROW_BATCH_ROWS),
                              "the saved dataset has no rows")


def _records(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    p = Path(path)
    fmt = data_format(p)
    if fmt == "save_to_disk":
        return _save_to_disk_records(p)
    if fmt == "parquet":
        return _parquet_records(p)
    return _jsonl_records(p)


def iter_examples(path: str | Path, fields: Fields = Fields()) -> Iterator[dict[str, Any]]:
    """Stream the examples of a data file in any supported format, every row checked and mapped
    (`Fields.to_example`); a malformed row is a `DataError` naming the file and the row."""
    for where, record in _records(path):
        yield fields.to_example(record, where)


def load_examples(path: str | Path, fields: Fields = Fields()) -> list[dict[str, Any]]:
    """All examples of a data file (see `iter_examples`)."""
    return list(iter_examples(path, fields))


def count_examples(path: str | Path, fields: Fields = Fields()) -> int:
    """Check every row of a data file without keeping it; the number of examples."""
    return sum(1 for _ in iter_examples(path, fields))


def count_rows(path: str | Path) -> int:
    """Rows of a data file without checking them (planning): non-blank lines of JSON lines,
    the row count in a Parquet footer or a saved dataset's metadata."""
    p = Path(path)
    fmt = data_format(p)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(p).metadata.num_rows)
    if fmt == "save_to_disk":
        import datasets

        return len(datasets.load_from_disk(str(p)))
    with open(p, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def load_split(data_cfg: Any, split: str) -> list[dict[str, Any]]:
    """The examples of `data.train_file` (split "train") or `data.val_file` ("val"), mapped by the
    recipe's fields."""
    path = data_cfg.train_file if split == "train" else data_cfg.val_file
    return load_examples(path, Fields.of(data_cfg))


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
