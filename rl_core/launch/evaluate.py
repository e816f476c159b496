"""The workflow's evaluate stage: chosen checkpoints x eval sets as one submitit job array.

Owns: which checkpoints are evaluated (`choose_checkpoints`: `final` is the last epoch's,
`best` the epoch with the highest validation accuracy, ties to the later; one epoch that is
both is evaluated once with both labels); the eval sets (`eval_sets`: `evaluation.sets`,
else `{val: data.val_file}`); the evaluation's sampling (`evaluation_validation_config`);
one array task per (checkpoint, set) (`evaluate_one`: verify, then
`stages.validate_checkpoint`), submitted with `map_array` (Slurm: one array with
`%max_parallel_array_tasks`; locally: waves of that many processes) and merged into
`evaluation.json`.

Does not own: validation metrics (rl_core.rollout.validation, via stages), executors and
waiting (job.py), per-epoch validation (the validate_epoch rule). Read more: docs/workflow.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rl_core.config import RecipeConfig, load_resolved
from rl_core.config.schema import ValidationConfig
from rl_core.errors import CheckpointError
from rl_core.fsutil import atomic_write_json
from rl_core.launch.job import make_executor, use_allocated_cpus, wait_for_jobs

METRICS = ("accuracy", "pass_at_k", "reward_mean", "reward_components", "mean_length", "truncation_rate", "num_prompts",
           "weight_version")


def eval_sets(cfg: RecipeConfig) -> dict[str, str]:
    return dict(cfg.evaluation.sets) or {"val": cfg.data.val_file}


def evaluation_validation_config(cfg: RecipeConfig) -> ValidationConfig:
    e = cfg.evaluation
    return ValidationConfig(val_at_start=False, val_at_end=False, max_val_samples=e.max_samples,
                            num_val_generations_per_prompt=e.num_generations_per_prompt, sampling=e.sampling)


def choose_checkpoints(cfg: RecipeConfig, epochs: dict[int, dict[str, str]]) -> dict[int, dict[str, Any]]:
    """`epochs`: k -> {"checkpoint": dir, "validation": validation.json}; returns k -> {labels, ...}."""
    if not epochs:
        raise CheckpointError("No epoch checkpoints to evaluate. Fix: train at least one epoch first.")
    accuracy = {}
    for k, paths in epochs.items():
        try:
            accuracy[k] = float(json.loads(Path(paths["validation"]).read_text())["accuracy"])
        except (OSError, KeyError, ValueError) as exc:
            raise CheckpointError(f"Validation file {paths['validation']} of epoch {k} cannot be read ({exc}). "
                                  f"Fix: rerun its validate_epoch rule.") from None
    wanted = {"final": max(epochs), "best": max(epochs, key=lambda k: (accuracy[k], k))}
    chosen: dict[int, dict[str, Any]] = {}
    for label in cfg.evaluation.checkpoints:
        k = wanted[label]
        entry = chosen.setdefault(k, {"epoch": k, "labels": [], "checkpoint": str(epochs[k]["checkpoint"]),
                                      "val_accuracy": accuracy[k]})
        entry["labels"].append(label)
    return chosen


def evaluate_one(resolved_config_path: str, checkpoint_dir: str, set_name: str, data_file: str,
                 out_json: str) -> dict:
    """One array task: evaluate one checkpoint on one prompt file (runs inside a submitit job)."""
    use_allocated_cpus()
    from rl_core.launch import stages

    cfg = load_resolved(resolved_config_path)
    return stages.validate_checkpoint(resolved_config_path, checkpoint_dir, out_json, split=set_name,
                                      data_file=data_file, validation=evaluation_validation_config(cfg))


def run_evaluation(resolved_config_path: str, epochs: dict[int, dict[str, str]], out_json: str,
                   launcher: str = "local") -> dict:
    """Evaluate the chosen checkpoints on every eval set as one job array; write `out_json`."""
    cfg = load_resolved(resolved_config_path)
    chosen = choose_checkpoints(cfg, epochs)
    sets = eval_sets(cfg)
    work = Path(out_json).with_suffix("")  # results/<run>/evaluation/
    tasks = [(k, name, file) for k in sorted(chosen) for name, file in sets.items()]
    outs = [str(work / f"epoch_{k}-{name}.json") for k, name, _ in tasks]
    print(f"[evaluate] {len(chosen)} checkpoint(s) x {len(sets)} set(s) = {len(tasks)} array task(s): "
          + ", ".join(f"epoch {k} ({'/'.join(chosen[k]['labels'])}) on {name}" for k, name, _ in tasks), flush=True)
    executor = make_executor(launcher, work / "submitit", cfg.cluster.evaluation, cfg.cluster,
                             f"rl_core-eval-{cfg.run_name}")
    wave = len(tasks) if launcher == "slurm" else cfg.cluster.max_parallel_array_tasks
    results: list[dict] = []
    for start in range(0, len(tasks), wave):
        part = tasks[start:start + wave]
        jobs = executor.map_array(evaluate_one, [str(resolved_config_path)] * len(part),
                                  [chosen[k]["checkpoint"] for k, _, _ in part], [n for _, n, _ in part],
                                  [f for _, _, f in part], outs[start:start + wave])
        print(f"[evaluate] submitted {launcher} array: {', '.join(j.job_id for j in jobs)}", flush=True)
        results += wait_for_jobs(jobs, "Evaluation", cfg.cluster.poll_interval_s,
                                 prefixes=[f"[epoch {k}/{n}] " for k, n, _ in part])
    k_gen = cfg.evaluation.num_generations_per_prompt
    rows = []
    for (k, name, file), res in zip(tasks, results):
        row = {"epoch": k, "labels": chosen[k]["labels"], "set": name, "data_file": file,
               "checkpoint": chosen[k]["checkpoint"], f"pass@{k_gen}": res[f"pass@{k_gen}"]}
        row.update({m: res[m] for m in METRICS if m in res})
        rows.append(row)
    out = {"k": k_gen, "sampling": cfg.evaluation.sampling.model_dump(mode="json"), "sets": sets,
           "checkpoints": {label: {"epoch": k, "checkpoint": c["checkpoint"], "val_accuracy": c["val_accuracy"]}
                           for k, c in chosen.items() for label in c["labels"]},
           "results": rows}
    atomic_write_json(out_json, out)
    return out
