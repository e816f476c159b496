"""Choosing the state a run continues from, and checking reused state against the recipe.

Owns: `check_run_checkpoint` (a run checkpoint is usable: its manifest verifies and the
trainer's state, the buffer's and `model/config.json` are there; any defect is one
`CheckpointError` naming the file, nothing loaded); `choose_resume` (the newest *intact*
step checkpoint, damaged newer ones moved into `damaged_checkpoints/`, never deleted);
`validate_resume_from` and `set_aside_newer` (`rl-core train --resume-from`: newer step
checkpoints go to `set_aside_checkpoints/`); `peek_resume` (what a plain rerun continues
from, moving and hashing nothing); `check_model_matches` (a reused policy or checkpoint has
the recipe's model shape, else an error naming both values and the fix).

Does not own: the checkpoint format (store.py), loading the state (run_state.py), or when a
run resumes (rl_core.launch.train / stages). Read more: docs/workflow.md, "Recovery".
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from rl_core.checkpoint.store import MANIFEST, checkpoint_order, load_json, read_manifest, verify_checkpoint
from rl_core.errors import CheckpointError

DAMAGED_DIR = "damaged_checkpoints"
SET_ASIDE_DIR = "set_aside_checkpoints"


# --------------------------------------------------------------------------- one checkpoint


def check_run_checkpoint(path: str | os.PathLike, hashes: bool = True) -> dict[str, Any]:
    """Verify a run checkpoint without loading it; returns its manifest (raises `CheckpointError`)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"Checkpoint {root} does not exist or is not a directory. Fix: pass a step "
                              f"checkpoint directory such as results/<run>/steps/step_000008.")
    manifest = verify_checkpoint(root, hashes=hashes)
    if not isinstance(manifest.get("rl_step"), int):
        raise CheckpointError(f"Checkpoint manifest {root / MANIFEST} has no integer `rl_step` (got "
                              f"{manifest.get('rl_step')!r}). Fix: use a checkpoint written by rl_core.")
    state = load_json(root / "controller_state.json")
    missing = None
    if not isinstance(state, dict):
        missing = f"is a JSON {type(state).__name__}, expected an object"
    elif not isinstance(state.get("trainer"), dict) or not isinstance(state["trainer"].get("version"), int):
        missing = "has no `trainer` object with an integer `version`"
    else:
        lost = [k for k in ("source", "sampler", "rollout") if not isinstance(state.get(k), dict)]
        if lost:
            missing = f"lacks the {', '.join(lost)} state"
    if missing:
        raise CheckpointError(f"Checkpoint file {root / 'controller_state.json'} {missing}; the run cannot continue "
                              f"from it. Fix: resume from another checkpoint (`rl-core train RECIPE --resume-from "
                              f"<checkpoint>`, or rerun the same command to fall back to the newest intact one).")
    buf = load_json(root / "buffer.json")
    if not (isinstance(buf, dict) and all(k in buf for k in ("capacity", "counts", "ready"))):
        raise CheckpointError(f"Checkpoint file {root / 'buffer.json'} lacks capacity / counts / ready. Fix: resume "
                              f"from another checkpoint (`rl-core train RECIPE --resume-from <checkpoint>`).")
    if not (root / "model" / "config.json").is_file():
        raise CheckpointError(f"Checkpoint {root} has no model/config.json. Fix: resume from another checkpoint.")
    return manifest


def _order_of(path: Path, manifest: dict[str, Any]) -> tuple[int, int]:
    """Position of a checkpoint in a run: (RL step, optimizer step when taken between mini-steps else -1)."""
    if manifest.get("open_step_next_ministep") is None:
        return (int(manifest["rl_step"]), -1)
    return (int(manifest["rl_step"]), int(manifest.get("optimizer_steps") or 0))


def _step_dirs(steps_dir: Path, prefix: str = "step_") -> list[Path]:
    """Every step directory (complete or not), oldest first."""
    if not steps_dir.is_dir():
        return []
    return sorted((p for p in steps_dir.iterdir() if p.is_dir() and p.name.startswith(prefix)
                   and checkpoint_order(p.name, prefix) >= (0, -1)), key=lambda p: checkpoint_order(p.name, prefix))


def _move_aside(path: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    target = into / f"{path.name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    n = 1
    while target.exists():
        target = target.with_name(f"{target.name}.{n}")
        n += 1
    os.replace(path, target)
    return target


# --------------------------------------------------------------------------- choosing


def choose_resume(steps_dir: str | os.PathLike, *, log: Callable[[str], None] = print,
                  none_intact: str = "raise") -> Path | None:
    """The newest intact step checkpoint under `steps_dir` (None when there is none at all).

    Damaged newer ones are moved into `<steps_dir>/../damaged_checkpoints/` and reported with
    `log`. When every step checkpoint is damaged: `none_intact="raise"` raises a
    `CheckpointError` (nothing moved); `"none"` moves them aside and returns None (the
    caller continues from an earlier stage's state, e.g. the previous epoch)."""
    steps = Path(steps_dir)
    damaged: list[tuple[Path, str]] = []
    chosen = None
    for cand in reversed(_step_dirs(steps)):
        try:
            check_run_checkpoint(cand)
        except CheckpointError as exc:
            damaged.append((cand, str(exc)))
            continue
        chosen = cand
        break
    if chosen is None and damaged and none_intact == "raise":
        newest, why = damaged[0]
        raise CheckpointError(
            f"No intact checkpoint in {steps}: all {len(damaged)} step checkpoints are damaged (the newest, {newest.name}: "
            f"{why}). Fix: pick a checkpoint from elsewhere with `rl-core train RECIPE --resume-from <checkpoint>`, or "
            f"move {steps} away to start the run again from its initial policy.")
    for path, why in damaged:
        moved = _move_aside(path, steps.parent / DAMAGED_DIR)
        log(f"[resume] {path} is damaged and was moved to {moved} (not deleted): {why}")
    if damaged:
        log(f"[resume] falling back to the newest intact checkpoint: {chosen if chosen else '(none; earlier state)'}")
    return chosen


def peek_resume(steps_dir: str | os.PathLike) -> Path | None:
    """The step checkpoint `choose_resume` will most likely pick, found without moving or hashing
    anything: the newest one whose manifest and controller state are structurally sound (None
    when there is none). For checks that must happen before the run writes anything (its model
    shape); `choose_resume` stays the authority (it also verifies sizes and hashes)."""
    for cand in reversed(_step_dirs(Path(steps_dir))):
        try:
            check_run_checkpoint(cand, hashes=False)
        except CheckpointError:
            continue
        return cand
    return None


def validate_resume_from(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """Validate a checkpoint picked with `--resume-from` (nothing moved or loaded); returns it and its manifest."""
    p = Path(path)
    if p.is_dir() and not (p / MANIFEST).exists():
        inner = [c for c in _step_dirs(p) if (c / MANIFEST).is_file()]
        if inner:
            raise CheckpointError(
                f"--resume-from {p} is a directory of step checkpoints, not one checkpoint. Fix: pass one of them, "
                f"e.g. --resume-from {inner[-1]} (the newest).")
    try:
        manifest = check_run_checkpoint(p)
    except CheckpointError as exc:
        raise CheckpointError(f"--resume-from {p}: {exc}") from None
    return p, manifest


def set_aside_newer(chosen: Path, manifest: dict[str, Any], steps_dir: str | os.PathLike,
                    log: Callable[[str], None] = print) -> None:
    """Move the step checkpoints of `steps_dir` that are newer than `chosen` into
    `<steps_dir>/../set_aside_checkpoints/`, so a later plain rerun continues from the chosen line."""
    order = _order_of(chosen, manifest)
    steps = Path(steps_dir)
    here = chosen.resolve()
    for cand in _step_dirs(steps):
        if cand.resolve() != here and checkpoint_order(cand.name) > order:
            moved = _move_aside(cand, steps.parent / SET_ASIDE_DIR)
            log(f"[resume] {cand} is newer than the chosen checkpoint; moved to {moved} (not deleted)")


# --------------------------------------------------------------------------- shape check

# model.tiny field -> config.json key
_TINY_KEYS = {
    "hidden_size": "hidden_size", "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size", "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings", "num_experts": "num_local_experts",
    "num_experts_per_tok": "num_experts_per_tok",
}
# config.json keys compared between an `hf` policy copy and model.path
_HF_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings")


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{what}: {path} cannot be read as JSON ({exc}). Fix: move the directory away and "
                              f"rebuild it.") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{what}: {path} is a JSON {type(obj).__name__}, expected an object. Fix: move the "
                              f"directory away and rebuild it.")
    return obj


def model_differences(cfg: Any, model_dir: str | os.PathLike,
                      saved_model_section: dict[str, Any] | None = None) -> list[tuple[str, Any, Any]]:
    """(recipe field, value in the recipe, value of the saved model) for each shape difference."""
    d = Path(model_dir)
    have = _read_json(d / "config.json", f"Model directory {d}")
    diffs: list[tuple[str, Any, Any]] = []
    if cfg.model.source == "tiny":
        tiny = cfg.model.tiny
        if have.get("model_type") != tiny.architecture:
            diffs.append(("model.tiny.architecture", tiny.architecture, have.get("model_type")))
        for field, key in _TINY_KEYS.items():
            want = getattr(tiny, field)
            if field.startswith("num_experts") and tiny.architecture != "mixtral":
                continue
            if key in have and have[key] != want:
                diffs.append((f"model.tiny.{field}", want, have[key]))
        saved_vocab = None
        if saved_model_section is not None:
            saved_vocab = (saved_model_section.get("tiny") or {}).get("tokenizer_vocab_size")
        else:
            report = d / "init_report.json"
            if report.is_file():
                saved_vocab = (_read_json(report, f"Initial policy {d}").get("tiny") or {}).get("tokenizer_vocab_size")
        if saved_vocab is not None and saved_vocab != tiny.tokenizer_vocab_size:
            diffs.append(("model.tiny.tokenizer_vocab_size", tiny.tokenizer_vocab_size, saved_vocab))
        elif isinstance(have.get("vocab_size"), int) and have["vocab_size"] > tiny.tokenizer_vocab_size:
            diffs.append(("model.tiny.tokenizer_vocab_size", tiny.tokenizer_vocab_size,
                          f"{have['vocab_size']} (config.json vocab_size)"))
    elif cfg.model.source in ("hf", "smollm2") and (cfg.model.path or cfg.model.source == "smollm2"):
        if cfg.model.source == "smollm2":  # the packaged model, converted once and cached
            from rl_core.model.gguf import smollm2_hf_dir

            src, what = smollm2_hf_dir() / "config.json", "model.source smollm2"
        else:
            src, what = Path(cfg.model.path) / "config.json", "model.path"
        if src.is_file():
            want_cfg = _read_json(src, what)
            for key in _HF_KEYS:
                if key in want_cfg and key in have and want_cfg[key] != have[key]:
                    diffs.append((f"{key} of {what} ({src})", want_cfg[key], have[key]))
    return diffs


def check_model_matches(cfg: Any, model_dir: str | os.PathLike, *, what: str, fix: str,
                        saved_model_section: dict[str, Any] | None = None) -> None:
    """Raise `CheckpointError` if the model saved in `model_dir` has another shape than the recipe's."""
    diffs = model_differences(cfg, model_dir, saved_model_section)
    if not diffs:
        return
    parts = "; ".join(f"{field} is {want!r} in the recipe but {got!r} in {what}" for field, want, got in diffs)
    overrides = " ".join(f"{f}={str(g).lower() if isinstance(g, bool) else g}" for f, _, g in diffs
                         if f.startswith("model.tiny.") and (f == "model.tiny.architecture" or not isinstance(g, str)))
    hint = f" (e.g. overrides {overrides})" if overrides else ""
    raise CheckpointError(f"{what[0].upper()}{what[1:]} was built for another model than the recipe asks for: {parts}. Using it would "
                          f"train the wrong model or fail late. Fix: set the recipe back to the saved values{hint}, "
                          f"or {fix}")


def check_checkpoint_matches(cfg: Any, checkpoint: str | os.PathLike, run_dir: str | os.PathLike) -> None:
    """A step checkpoint to resume has the recipe's model shape (its model/ and resolved_config.json)."""
    ck = Path(checkpoint)
    saved = None
    resolved = ck / "resolved_config.json"
    if resolved.is_file():
        saved = _read_json(resolved, f"Checkpoint {ck}").get("model")
    check_model_matches(cfg, ck / "model", what=f"checkpoint {ck}", saved_model_section=saved,
                        fix=f"start a new run (another run_name, or move {Path(run_dir) / 'steps'} away), or pick "
                            f"another checkpoint with --resume-from.")
