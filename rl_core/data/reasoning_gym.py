"""Data files of a reasoning-gym task: `rl-core make-data reasoning_gym`.

Owns: generating a task's training and held-out examples with seeds and writing them as
JSON lines (`make_reasoning_gym_data`: item i from `seed + i` alone, so the same arguments
write byte-identical files; the held-out set from `seed + VAL_SEED_OFFSET`, skipping every
training question: fixed and disjoint), building the task's dataset object (`task_dataset`,
errors naming the recipe or command-line field), and `generate_recipe_data`, the recipe's
`data.generate` (the workflow's make_data stage and `rl-core train`): the same files under
<output_dir>/<run_name>/data/ beside a `generate.json` recording what they were made from
(files without it are never overwritten; make-data writes it too), and
`check_data_matches_env`: a recipe's `env.task` / `env.config` must be what its files were made with.

Does not own: scoring (rl_core.envs.reasoning_gym) or reading the files (dataset.py).
Read more: docs/environments.md, "reasoning_gym".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rl_core.data.addition import to_jsonl
from rl_core.fsutil import atomic_write_text

TRAIN_FILE, VAL_FILE = "train.jsonl", "val.jsonl"
VAL_SEED_OFFSET = 10**9


def task_dataset(task: str, config: dict[str, Any], size: int = 1, seed: int = 0, *,
                 task_field: str = "env.task", config_field: str = "env.config") -> Any:
    """`reasoning_gym.create_dataset(task, size=size, seed=seed, **config)`; an unknown task or a
    config the task refuses is a RecipeError naming `task_field` / `config_field`."""
    from rl_core.errors import RecipeError

    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise RecipeError.single(task_field, task, f"the reasoning-gym package (not importable: {exc})",
                                 "install rl_core's `tasks` extra: pip install -e '.[tasks]' (make setup does).") from None
    if task not in DATASETS:
        import difflib

        close = difflib.get_close_matches(task, sorted(DATASETS), n=3)
        raise RecipeError.single(task_field, task, f"a reasoning-gym task name ({len(DATASETS)} known"
                                 + (f"; close: {', '.join(close)}" if close else "") + ")",
                                 "pick a name from reasoning_gym.factory.DATASETS (e.g. basic_arithmetic, chain_sum).")
    bad = [k for k in ("size", "seed") if k in config]
    if bad:
        raise RecipeError.single(config_field, config, f"the task's settings without {', '.join(bad)}",
                                 "sizes and seeds are make-data's --num-train/--num-val/--seed; remove them from the config.")
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    except (TypeError, ValueError, AssertionError) as exc:
        raise RecipeError.single(config_field, config, f"settings the {task} task accepts ({type(exc).__name__}: {exc})",
                                 f"fix the settings (see the fields of {task}'s config class in reasoning_gym).") from None


def _row(i: int, task: str, entry: dict[str, Any]) -> dict[str, Any]:
    metadata = json.loads(json.dumps(entry.get("metadata") or {}, default=str))
    return {"id": i, "prompt": str(entry["question"]), "answer": str(entry["answer"]), "task": task,
            "metadata": metadata}


CLI_FIELDS = {"task": "--name", "config": "--config", "num_val": "--num-val", "num_train": "--num-train"}
RECIPE_FIELDS = {"task": "env.task", "config": "env.config", "num_val": "data.generate.num_val",
                 "num_train": "data.generate.num_train"}
SPEC_FILE = "generate.json"


def reasoning_gym_examples(task: str, config: dict[str, Any], num_train: int, num_val: int, seed: int = 0,
                           fields: dict[str, str] = CLI_FIELDS) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, val) rows of `task` (see the module docstring); errors name `fields` (make-data's
    options, or the recipe's fields with RECIPE_FIELDS)."""
    from rl_core.errors import RecipeError

    train_ds = task_dataset(task, config, size=num_train, seed=seed, task_field=fields["task"], config_field=fields["config"])
    train = [_row(i, task, train_ds[i]) for i in range(num_train)]
    seen = {r["prompt"] for r in train}
    tries = 20 * num_val + 100
    val_ds = task_dataset(task, config, size=tries, seed=seed + VAL_SEED_OFFSET, task_field=fields["task"],
                          config_field=fields["config"])
    val: list[dict[str, Any]] = []
    for j in range(tries):
        row = _row(num_train + len(val), task, val_ds[j])
        if row["prompt"] in seen:
            continue
        seen.add(row["prompt"])
        val.append(row)
        if len(val) == num_val:
            break
    if len(val) < num_val:
        raise RecipeError.single(fields["num_val"], num_val, f"at most the {len(val)} held-out questions of {task} that "
                                 f"are not in the training set (the task has few distinct questions with this config)",
                                 f"lower {fields['num_val']} or {fields['num_train']}, or widen the task's config.")
    return train, val


def make_reasoning_gym_data(out_dir: str | Path, task: str, config: dict[str, Any], num_train: int, num_val: int,
                            seed: int = 0) -> dict[str, Any]:
    """Write `train.jsonl` and `val.jsonl` of a reasoning-gym task (atomically, validation first)."""
    train, val = reasoning_gym_examples(task, config, num_train, num_val, seed)
    out = Path(out_dir)
    atomic_write_text(out / VAL_FILE, to_jsonl(val))
    atomic_write_text(out / TRAIN_FILE, to_jsonl(train))
    spec = {"task": task, "config": config, "num_train": num_train, "num_val": num_val, "seed": seed}
    atomic_write_text(out / SPEC_FILE, json.dumps(spec, indent=1, sort_keys=True) + "\n")  # what env.config must match
    return {"train_file": str(out / TRAIN_FILE), "val_file": str(out / VAL_FILE), "num_train": len(train),
            "num_val": len(val), "task": task, "config": config, "seed": seed}


def generate_recipe_data(cfg: Any, log: Any = print) -> bool:
    """Write the recipe's `data.generate` files (train_file, val_file) unless they already hold
    exactly what the recipe generates; True when something was written. Files that differ and
    lack the `generate.json` marker are not rl_core's: a DataError, nothing overwritten."""
    from rl_core.data.addition import to_jsonl
    from rl_core.errors import DataError

    gen = cfg.data.generate
    if gen is None:
        return False
    spec = {"task": cfg.env.task, "config": cfg.env.config, "num_train": gen.num_train, "num_val": gen.num_val,
            "seed": gen.seed}
    train, val = reasoning_gym_examples(cfg.env.task, cfg.env.config, gen.num_train, gen.num_val, gen.seed,
                                        fields=RECIPE_FIELDS)
    texts = {cfg.data.train_file: to_jsonl(train), cfg.data.val_file: to_jsonl(val)}
    marker = Path(cfg.data.train_file).parent / SPEC_FILE

    def holds(path: str, text: str) -> bool:
        try:
            return Path(path).read_text() == text
        except (OSError, UnicodeDecodeError):
            return False

    differ = [p for p, t in texts.items() if not holds(p, t)]  # each file read once
    if not differ:
        return False
    foreign = [p for p in differ if Path(p).exists()]
    if foreign and not marker.is_file():
        raise DataError(f"`data.generate`: {foreign[0]} exists with other content and without rl_core's marker "
                        f"{marker}, so rl_core did not write it and will not overwrite it. Expected: a run "
                        f"directory whose data/ rl_core generated. Fix: move that file away, or use another "
                        f"run_name / output_dir.")
    log(f"[data] generating {gen.num_train} training and {gen.num_val} held-out examples of {cfg.env.task} "
        f"(seed {gen.seed}) into {marker.parent}")
    atomic_write_text(marker, json.dumps(spec, indent=1, sort_keys=True) + "\n")
    for path, text in ((cfg.data.val_file, texts[cfg.data.val_file]), (cfg.data.train_file, texts[cfg.data.train_file])):
        atomic_write_text(Path(path), text)
    return True


def check_data_matches_env(env: Any, files: list[tuple[str, str]], source: str | None = None) -> None:
    """A reasoning_gym environment scores with the task built from `env.task` / `env.config`: the
    data files must come from the same task and settings, as their `generate.json` (written by
    make-data and `data.generate`) and each file's first row (`task`) record; a RecipeError
    naming `env.task` or `env.config` otherwise. `files`: (field, path) pairs."""
    from rl_core.data.dataset import data_format, iter_jsonl
    from rl_core.errors import DataError, RecipeError

    def canon(value: Any) -> str:
        return json.dumps(value, sort_keys=True, default=str)

    for field, path in files:
        marker = Path(path).parent / SPEC_FILE
        spec = None
        if marker.is_file():
            try:
                spec = json.loads(marker.read_text())
            except (OSError, ValueError):
                spec = None
        if isinstance(spec, dict) and spec.get("task") == env.task and canon(spec.get("config")) != canon(dict(env.config)):
            raise RecipeError.single("env.config", dict(env.config), f"the settings {field} ({path}) was generated "
                                     f"with: {canon(spec.get('config'))} (recorded in {marker})",
                                     "set env.config to those settings (the task scores answers with them), or "
                                     "regenerate the data with this config (rl-core make-data reasoning_gym "
                                     "--config ...).", source)
        task = spec.get("task") if isinstance(spec, dict) else None
        if task is None and data_format(path) == "jsonl":
            try:
                first = next(iter_jsonl(path, ()), {})
            except DataError:  # a malformed file: the preflight's data check names it
                first = {}
            task = first.get("task") if isinstance(first.get("task"), str) else None
        if task is not None and task != env.task:
            raise RecipeError.single("env.task", env.task, f"the task {field} ({path}) holds: {task!r}",
                                     f"set env.task: {task}, or point {field} at data of {env.task}.", source)
