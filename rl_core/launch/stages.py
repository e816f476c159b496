"""The workflow's stages as plain functions (called by workflow/scripts and the submitit job).

Owns: what each Snakemake stage computes and writes, and the epoch plan:
- `plan_epochs`: which RL steps belong to which epoch (cheap: counts lines, no torch);
- `validate_recipe`: recipe + overrides -> resolved_config.json;
- `init_policy`: the initial policy HF directory;
- `train_epoch`: run the controller from the previous epoch's checkpoint to the end of
  epoch k, resuming from the newest intact step checkpoint of this epoch if a previous
  attempt was killed (damaged newer ones are moved to `epoch_k/damaged_checkpoints/`, and
  the model shape of what it continues from is checked against the recipe); ends in
  `epoch_k/checkpoint/` (atomic, manifest last);
- `validate_checkpoint`: accuracy / pass@k of a checkpoint on a prompt file;
- `log_validations_tensorboard`: the validations as TensorBoard scalars at their RL steps.

Epoch k (1-based) holds RL steps [first_step, end_step): step s trains on prompt batch s,
and batch s belongs to rollout-side epoch s // batches_per_epoch. In reproducible mode an
epoch run also generates the groups of the next `lookahead` steps (with the weights they
are pinned to) and keeps them in its checkpoint, so a workflow run equals a single
continuous run bit for bit.

Does not own: the controller, the checkpoint format, the Snakefile, or submitit.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from rl_core.config import RecipeConfig, load_recipe, load_resolved, write_resolved
from rl_core.errors import CheckpointError, RecipeError


def load_workflow_recipe(recipe: str, run: str | None, overrides: list[str] | None = None) -> RecipeConfig:
    """The recipe as the workflow runs it: outputs under results/<run>; `run` None = the recipe's
    own `run_name` (after the overrides)."""
    cfg = load_recipe(recipe, [*(overrides or []), *([f"run_name={run}"] if run else []), "output_dir=results"])
    return cfg


def _count_examples(path: str) -> int:
    from rl_core.data.dataset import count_rows

    return count_rows(path)


def plan_epochs(cfg: RecipeConfig) -> list[dict]:
    n = _count_examples(cfg.data.train_file)
    if cfg.data.max_train_examples is not None:
        n = min(n, cfg.data.max_train_examples)
    per_epoch = n // cfg.grpo.num_prompts_per_step
    if per_epoch < 1:
        raise RecipeError.single("grpo.num_prompts_per_step", cfg.grpo.num_prompts_per_step,
                                 f"at most the number of training examples ({n})",
                                 "lower grpo.num_prompts_per_step or use more training examples.")
    epochs = cfg.grpo.max_num_epochs or math.ceil(cfg.grpo.max_num_steps / per_epoch)
    total = min(cfg.grpo.max_num_steps, epochs * per_epoch)
    plan = []
    for k in range(1, math.ceil(total / per_epoch) + 1):
        plan.append({"epoch": k, "first_step": (k - 1) * per_epoch, "end_step": min(k * per_epoch, total),
                     "steps_per_epoch": per_epoch, "total_steps": total})
    return plan


def validate_recipe(recipe: str, run: str, overrides: list[str] | None, out_path: str) -> None:
    cfg = load_workflow_recipe(recipe, run, overrides)
    path = write_resolved(cfg, Path(out_path).parent)
    if path != Path(out_path):
        shutil.move(str(path), out_path)


def init_policy(resolved_config_path: str, out_dir: str) -> dict:
    from rl_core.launch.train import ensure_policy, setup_process

    cfg = load_resolved(resolved_config_path)
    setup_process(cfg)
    ensure_policy(cfg, out_dir)
    report = Path(out_dir) / "init_report.json"
    return json.loads(report.read_text()) if report.exists() else {}


def _epoch_entry(cfg: RecipeConfig, epoch: int) -> dict:
    plan = plan_epochs(cfg)
    if not 1 <= epoch <= len(plan):
        raise RecipeError.single("(workflow) epoch", epoch, f"an epoch in 1..{len(plan)} for this recipe",
                                 "ask for an existing epoch target (results/<run>/epoch_<k>/...).")
    return plan[epoch - 1]


def train_epoch(resolved_config_path: str, epoch: int, prev_checkpoint: str, epoch_dir: str) -> dict:
    """Train epoch `epoch` into `epoch_dir/checkpoint`; resumable (see module docstring)."""
    from rl_core.checkpoint import check_checkpoint_matches, check_model_matches, choose_resume, load_run_checkpoint
    from rl_core.launch.train import truncate_metrics, run_controller, setup_process
    from rl_core.rollout.spool import RolloutSpool

    cfg = load_resolved(resolved_config_path)
    entry = _epoch_entry(cfg, epoch)
    edir = Path(epoch_dir)
    from rl_core.fsutil import check_replaceable

    check_replaceable(edir / "checkpoint", "epoch checkpoint")  # replaced at the end: say so before training
    edir.mkdir(parents=True, exist_ok=True)
    steps_dir = edir / "steps"
    setup_process(cfg)
    from rl_core.train import start_trainer_group

    if start_trainer_group(cfg):  # ranks > 0 of a multi-process trainer followed rank 0 until the end
        return {}
    # the newest intact step checkpoint of this epoch (damaged ones moved to epoch_k/damaged_checkpoints/)
    latest = choose_resume(steps_dir, none_intact="none")
    resume = None
    policy_dir = None
    if latest is not None:
        check_checkpoint_matches(cfg, latest, edir)
        resume = load_run_checkpoint(latest, verified=True)
        print(f"[resume] epoch {epoch}: continuing from {latest} (RL step {resume.rl_step})", flush=True)
    elif (Path(prev_checkpoint) / "manifest.json").is_file():
        check_checkpoint_matches(cfg, prev_checkpoint, edir)
        resume = load_run_checkpoint(prev_checkpoint)
    else:
        if entry["first_step"] != 0:
            raise CheckpointError(f"Epoch {epoch} starts at RL step {entry['first_step']} but {prev_checkpoint} is not "
                                  "a run checkpoint (no manifest.json). Fix: pass the previous epoch's checkpoint.")
        policy_dir = prev_checkpoint
        check_model_matches(cfg, policy_dir, what=f"the initial policy {policy_dir}",
                            fix=f"move {policy_dir} away and rerun the workflow, which rebuilds it for this recipe.")
    start = resume.rl_step if resume is not None else 0
    if not entry["first_step"] <= start <= entry["end_step"]:
        raise CheckpointError(f"Checkpoint {resume.path} is at RL step {start}, outside epoch {epoch} "
                              f"(steps {entry['first_step']}..{entry['end_step']}). Fix: pass the checkpoint of "
                              f"epoch {epoch - 1}.")
    truncate_metrics(edir / "metrics.jsonl", start)
    spool = RolloutSpool(edir / "rollouts.spool")
    spool.truncate_after(start)
    summary = run_controller(cfg, edir, policy_dir=policy_dir, stop_step=entry["end_step"], resume=resume,
                             checkpoint_dir=steps_dir, spool_dir=spool.dir, val_at_start=False, val_at_end=False)
    final = steps_dir / f"step_{entry['end_step']:06d}"
    if not (final / "manifest.json").is_file():
        raise CheckpointError(f"Epoch {epoch} ended without its final checkpoint {final}.")
    target = edir / "checkpoint"
    if target.exists():
        from rl_core.fsutil import check_replaceable

        check_replaceable(target, "epoch checkpoint")  # only one rl_core wrote (marker or rl_core manifest)
        shutil.rmtree(target)
    final.rename(target)
    from rl_core.checkpoint import prune

    prune(steps_dir, 0)  # the epoch's other step checkpoints (rl_core's own); anything else stays
    try:
        steps_dir.rmdir()
    except OSError:
        pass
    summary["epoch"] = epoch
    summary.update({k: entry[k] for k in ("first_step", "end_step")})
    from rl_core.fsutil import atomic_write_json

    atomic_write_json(edir / "summary.json", summary)
    return summary


VALIDATION_SCALARS = ("accuracy", "reward_mean", "mean_length", "truncation_rate")


def log_validations_tensorboard(results: list[dict], tb_dir: str | Path) -> Path:
    """Held-out validations' scalars as TensorBoard events (`val/accuracy`, `val/pass@n`,
    `val/pass_at_k/<k>`, ...), each at its weight version, which is the RL step of metrics.jsonl
    (0 for the initial policy): in the workflow the before-RL and end-of-epoch validations, one
    curve in results/<run>/tensorboard/validation. One event file, written in step order
    (TensorBoard reads a run's events in file order; validations finish in any order), that
    replaces the one an earlier call wrote (suffix `.rl_core-validation`), no other file."""
    from torch.utils.tensorboard import SummaryWriter

    d = Path(tb_dir)
    d.mkdir(parents=True, exist_ok=True)
    suffix = ".rl_core-validation"
    for old in d.glob(f"events.out.tfevents.*{suffix}"):  # written by an earlier call
        old.unlink()
    writer = SummaryWriter(log_dir=str(d), filename_suffix=suffix)
    try:
        for result in sorted(results, key=lambda r: int(r["weight_version"])):
            step = int(result["weight_version"])
            for key, value in result.items():
                if key in VALIDATION_SCALARS or key.startswith("pass@"):
                    writer.add_scalar(f"val/{key}", float(value), step)
            for k, value in (result.get("pass_at_k") or {}).items():
                writer.add_scalar(f"val/pass_at_k/{k}", float(value), step)
    finally:
        writer.close()
    return next(d.glob(f"events.out.tfevents.*{suffix}"))


def validate_checkpoint(resolved_config_path: str, checkpoint_dir: str, out_json: str, split: str = "val",
                        data_file: str | None = None, validation=None) -> dict:
    """Validation metrics of one checkpoint (or HF policy directory) on a prompt file.

    `validation`: a ValidationConfig to use instead of the recipe's (the evaluate stage
    passes one built from the recipe's `evaluation` section)."""
    import asyncio

    from transformers import AutoTokenizer

    from rl_core.checkpoint import verify_checkpoint
    from rl_core.data.dataset import Fields, load_examples
    from rl_core.envs import make_env
    from rl_core.fsutil import atomic_write_json
    from rl_core.generation.backend import NativeBackend
    from rl_core.generation.engine import NativeEngine
    from rl_core.launch.train import setup_process
    from rl_core.train import trainer_device
    from rl_core.rollout.validation import Validator

    cfg = load_resolved(resolved_config_path)
    setup_process(cfg)
    ck = Path(checkpoint_dir)
    version = 0
    if (ck / "manifest.json").is_file():
        manifest = verify_checkpoint(ck)
        version = int(manifest["weight_version"])
        model_dir = ck / "model"
    else:
        model_dir = ck
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    env = make_env(cfg.env, tokenizer)
    examples = load_examples(data_file or cfg.data.val_file, Fields.of(cfg.data))
    engine = NativeEngine.from_pretrained(model_dir, device=trainer_device(cfg), dtype=cfg.model.dtype,
                                          max_batch_size=cfg.generation.max_batch_size, weight_version=version,
                                          decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    backend = NativeBackend(engine)
    stop = tuple(dict.fromkeys(i for i in (*env.end_token_ids, tokenizer.eos_token_id) if i is not None))
    validator = Validator(validation or cfg.validation, env, tokenizer, examples, cfg.grpo.seed, stop)

    async def go():
        await backend.start()
        try:
            return await validator.run(backend, split)
        finally:
            await backend.shutdown()
            await env.aclose()

    result = asyncio.run(go())
    result.update({"checkpoint": str(ck), "split": split, "data_file": data_file or cfg.data.val_file})
    atomic_write_json(out_json, result)
    return result
