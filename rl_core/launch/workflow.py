"""The Python side of the Snakemake workflow: the parse-time plan and running a stage in a rule.

Owns: `load_workflow` (at parse time, imported by `workflow/rules/common.smk`, so torch-free:
the workflow config checked against `workflow/schemas/config.schema.yaml`, the recipe loaded
with its overrides, the epochs planned, a branch source checked; every problem a `RecipeError`
paragraph raised before any job runs; returns the `WorkflowPlan`, the run's paths in one
place, and a branch's plan: which epochs are linked and which of their results the source's
still are, `reused_archives` / `reused_validations`); `write_stage_digests` / `stage_config`
(change detection: one digest file per stage, and the resolved recipe a stage job runs with);
and `run_in_rule` (a rule's output into its `log:`, a `UserError` as one paragraph, exit 2).

Does not own: the rules (workflow/rules/*.smk), what the stages compute (stages.py), the
submitit jobs (job.py, evaluate.py). Read more: docs/workflow.md.
"""

from __future__ import annotations

import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from rl_core.config import RecipeConfig
from rl_core.errors import RecipeError, UserError
from rl_core.report.render import PLOTS

SOURCE = "the workflow config (config/config.yaml, --configfile or --config)"
# recipe sections that never change the training's result (names, where outputs go, how jobs are placed,
# logging, and the stages after training: held-out validation and evaluation have their own digests)
NO_STAGE = ("run_name", "output_dir", "cluster", "logging")  # top-level recipe fields that rerun no stage
NOT_RESULTS = {*NO_STAGE, "evaluation", "validation"}
# the sections each stage's result depends on (None: all but NOT_RESULTS); what the README's change
# classes promise: a trainer knob retrains, a validation knob re-validates, an eval set re-evaluates,
# `cluster:` reruns nothing
STAGE_SECTIONS: dict[str, tuple[str, ...] | None] = {
    "data": ("data.generate", "env.task", "env.config"),  # the make_data stage (only with data.generate)
    "init": ("model", "data", "env", "runtime", "grpo.seed", "generation.max_tokens"),
    "train": None,
    "validate": ("validation", "env", "data.val_file", "model.dtype", "runtime", "grpo.seed"),
    "evaluate": ("evaluation", "env", "data.val_file", "model.dtype", "runtime", "grpo.seed"),
}


@dataclass
class WorkflowPlan:
    """What the rules need: the run, its recipe, its epochs and every output path."""

    run: str
    recipe: str
    overrides: list[str]
    launcher: str
    cfg: RecipeConfig
    epochs: list[dict]
    recipe_files: list[str]
    branch_from: str | None = None
    branch_epoch: int = 0  # epochs 1..branch_epoch come from branch_from's run

    def job_launcher(self, executor_plugin: Any) -> str:
        """Where submitit jobs go: `launcher` from the config, or with `auto` (the default) Slurm
        exactly when snakemake itself runs with the Slurm executor (`--profile profiles/slurm`)."""
        if self.launcher != "auto":
            return self.launcher
        name = getattr(executor_plugin, "name", "") or ""
        return "slurm" if name.startswith("slurm") else "local"

    @property
    def run_dir(self) -> str:
        return f"results/{self.run}"

    @property
    def num_epochs(self) -> int:
        return len(self.epochs)

    @property
    def resolved(self) -> str:
        return f"{self.run_dir}/resolved_config.json"

    @property
    def init_policy(self) -> str:
        return f"{self.run_dir}/init_policy"

    def epoch_dir(self, k: int | str) -> str:
        return f"{self.run_dir}/epoch_{k}"

    def trained_epochs(self) -> list[int]:
        return [e["epoch"] for e in self.epochs if e["epoch"] > self.branch_epoch]

    def branched_epochs(self) -> list[int]:
        return [e["epoch"] for e in self.epochs if e["epoch"] <= self.branch_epoch]

    def epochs_but(self, taken: list[int]) -> list[int]:
        """Every epoch but `taken` (those whose result a branch takes from its source)."""
        return [e["epoch"] for e in self.epochs if e["epoch"] not in taken]

    def source_epoch_dir(self, k: int | str) -> str:
        assert self.branch_from is not None
        return str(Path(self.branch_from).parent / f"epoch_{k}")

    def source_init_policy(self, name: str = "") -> str:
        """The branch source run's initial policy (a branch links it instead of building one)."""
        assert self.branch_from is not None
        return str(Path(self.branch_from).parent / "init_policy" / name).rstrip("/")

    def source_result(self, name: str) -> str:
        """A result file of the branch source run (e.g. 'epoch_1/rollouts.h5', 'init_validation.json')."""
        assert self.branch_from is not None
        return str(Path(self.branch_from).parent / name)

    def reused_archives(self) -> list[int]:
        """Linked epochs whose archive is the source's (it exists there): copied, not recompiled."""
        return [k for k in self.branched_epochs() if Path(self.source_result(f"epoch_{k}/rollouts.h5")).is_file()]

    def _reusable_validation(self, name: str) -> bool:
        """Whether the source's validation result `name` holds here (same validation recipe values,
        up to date there); call after write_stage_digests (it reads this run's digest file)."""
        from rl_core.launch.branch import reusable_validation

        return self.branch_from is not None and reusable_validation(
            Path(self.source_result(name)), Path(self.stage_digest("validate")),
            Path(self.source_result(".stage-digests/validate.json")), self.data_inputs("validate"))

    def reused_validations(self) -> list[int]:
        """Linked epochs whose validation.json is the source's (see _reusable_validation)."""
        return [k for k in self.branched_epochs() if self._reusable_validation(f"epoch_{k}/validation.json")]

    def reuses_init_validation(self) -> bool:
        """A branch's initial policy is its source's: so is its before-RL validation, when it holds."""
        return self._reusable_validation("init_validation.json")

    def prev_checkpoint(self, k: int | str) -> str:
        k = int(k)
        return self.init_policy if k == 1 else f"{self.epoch_dir(k - 1)}/checkpoint"

    @property
    def evaluation(self) -> str:
        return f"{self.run_dir}/evaluation.json"

    @property
    def report(self) -> str:
        return f"{self.run_dir}/report.html"

    def plots(self) -> list[str]:
        return [f"{self.run_dir}/report/{name}.png" for name in PLOTS]

    def per_epoch(self, name: str) -> list[str]:
        """`name` (e.g. 'checkpoint', 'validation.json') of every epoch."""
        return [f"{self.epoch_dir(e['epoch'])}/{name}" for e in self.epochs]

    @property
    def generated_data(self) -> list[str]:
        """The make_data stage's outputs (`data.generate`: train, val and the marker), else []."""
        if self.cfg.data.generate is None:
            return []
        from rl_core.data.reasoning_gym import SPEC_FILE

        return [self.cfg.data.train_file, self.cfg.data.val_file, f"{self.cfg.generated_data_dir}/{SPEC_FILE}"]

    def data_inputs(self, stage: str) -> list[str]:
        """The data files `stage`'s result depends on, as rule inputs: Snakemake's mtime check then
        reruns the stage when a file's content is edited in place (the digests hold only paths).
        A save_to_disk directory is listed file by file (a directory's mtime misses edits)."""
        d = self.cfg.data
        names = {"init": [d.train_file, d.val_file], "train": [d.train_file, d.val_file],
                 "validate": [d.val_file], "evaluate": [d.val_file, *self.cfg.evaluation.sets.values()]}[stage]
        out: list[str] = []
        for name in dict.fromkeys(names):
            p = Path(name)
            if p.is_dir():
                out += sorted(str(f) for f in p.rglob("*") if f.is_file())
            else:
                out.append(name)
        return out

    def stage_sections(self, stage: str) -> dict[str, Any]:
        """The recipe values `stage`'s result depends on (STAGE_SECTIONS), as JSON-able data.

        Only values that differ from the schema's defaults: a new rl_core release that adds a
        knob (with a default) leaves the digests, and so the finished stages, as they were."""
        data = self.cfg.model_dump(mode="json", exclude_defaults=True)
        keep = STAGE_SECTIONS[stage]
        if keep is None:  # everything but what cannot change the result
            return {k: v for k, v in sorted(data.items()) if k not in NOT_RESULTS}
        part = {}
        for key in keep:  # "section" or "section.field"
            value = data
            for name in key.split("."):
                value = value.get(name) if isinstance(value, dict) else None
            if value is not None:
                part[key] = value
        return part

    def digest(self, stage: str) -> str:
        """A hash of the recipe values `stage` depends on (`stage_sections`)."""
        import hashlib
        import json

        blob = json.dumps(self.stage_sections(stage), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def stage_digest(self, stage: str) -> str:
        """The digest file of `stage`: a normal input of the stage's rules (see write_stage_digests)."""
        return f"{self.run_dir}/.stage-digests/{stage}.json"

    def write_stage_digests(self) -> list[str]:
        """Write every stage's digest file at parse time; a file is rewritten only when its content
        changes, so its mtime moves exactly when a knob that can change the stage's result moved.

        Why files and not a `params:` hash: Snakemake does not look at the params (or inputs) of a
        job downstream of a job that must run when their only link is an `ancient()` input, so a
        changed knob took several invocations to reach the stages. A digest file is a source
        file of the stage's own rule (no job makes it), so Snakemake's mtime check sees it in the
        same run, and everything downstream of a rerun stage reruns through the DAG. Snakemake
        also records a checksum of small inputs: a dry run (-n) of a change that is then
        abandoned rewrites the file back to the content the outputs were built from, which
        Snakemake recognises (same checksum), so nothing reruns."""
        import json

        from rl_core.fsutil import atomic_write_text

        written = []
        for stage in STAGE_SECTIONS:
            if stage == "data" and not self.generated_data:  # no make_data rule to read it
                continue
            path = Path(self.stage_digest(stage))
            text = json.dumps({"stage": stage, "digest": self.digest(stage),
                               "sections": self.stage_sections(stage)}, indent=1, sort_keys=True) + "\n"
            try:
                if path.read_text() == text:
                    continue
            except OSError:
                pass
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, text)
            written.append(str(path))
        return written

    @staticmethod
    def epoch_regex(epochs: list[int]) -> str:
        return "|".join(str(k) for k in epochs) if epochs else "(?!)"


def _schema_problems(config: dict, schema_path: str | os.PathLike) -> list[dict]:
    import jsonschema

    schema = yaml.safe_load(Path(schema_path).read_text())
    problems = []
    for err in sorted(jsonschema.Draft7Validator(schema).iter_errors(config), key=lambda e: list(e.absolute_path)):
        path = ".".join(str(p) for p in err.absolute_path)
        if err.validator == "additionalProperties":
            known = ", ".join(sorted(schema.get("properties", {})))
            extra = sorted(set(config) - set(schema.get("properties", {})))
            problems.append({"field": ", ".join(extra) or "(top level)",
                             "value": config[extra[0]] if len(extra) == 1 else [config[k] for k in extra],
                             "expected": f"only the known keys ({known})",
                             "fix": "remove or rename the key (workflow/schemas/config.schema.yaml documents each)."})
            continue
        if err.validator == "required":
            missing = err.message.split("'")[1] if "'" in err.message else err.message
            problems.append({"field": missing, "value": None, "missing": True, "expected": "a value",
                             "fix": f"set `{missing}` in config/config.yaml or pass --config {missing}=..."})
            continue
        desc = err.schema.get("description", "") if isinstance(err.schema, dict) else ""
        what = {"enum": f"one of {err.validator_value}", "pattern": f"a string matching {err.validator_value}",
                "type": f"a value of JSON type {err.validator_value}"}.get(err.validator, err.message)
        expected = what + (f" ({desc})" if desc else "")
        problems.append({"field": path or "(top level)", "value": err.instance, "expected": expected,
                         "fix": f"fix `{path}` in config/config.yaml or on the command line (--config {path}=...)."})
    return problems


def recipe_chain(recipe: str) -> list[str]:
    """The recipe file and every file it `extends:` (rerun triggers for validate_recipe)."""
    out, path = [], Path(recipe)
    while path.is_file() and str(path) not in out:
        out.append(str(path))
        base = (yaml.safe_load(path.read_text()) or {}).get("extends")
        if not base:
            break
        path = path.parent / base
    return out


def load_workflow(config: dict, schema_path: str | os.PathLike, command_line: dict | None = None) -> WorkflowPlan:
    """Validate the workflow config, load the recipe and plan the run (no torch, no jobs).
    `command_line`: the keys given with `--config` (Snakemake reads `KEY=` as null): an empty
    `run=` or `recipe=` is refused, not read as "the recipe's own"."""
    from rl_core.launch.stages import load_workflow_recipe, plan_epochs

    for key in ("run", "recipe"):
        if command_line and key in command_line and command_line[key] in (None, ""):
            raise RecipeError.single(key, "", "a run name (letters, digits, '.', '_', '-')" if key == "run" else
                                     "a recipe file", f"pass --config {key}=NAME, or leave --config {key}= out "
                                     + ("to use the recipe's run_name." if key == "run" else "to use config/config.yaml's."),
                                     "snakemake --config")
    config = dict(config)
    problems = _schema_problems(config, schema_path)
    if problems:
        raise RecipeError(problems, SOURCE)
    recipe = config["recipe"]
    if not Path(recipe).is_file():
        from rl_core.config.loader import recipes_hint

        raise RecipeError.single("recipe", recipe, f"an existing recipe file (looked for {Path(recipe).resolve()})",
                                 f"set `recipe` (config/config.yaml or --config recipe=...); {recipes_hint()}.", SOURCE)
    overrides = [str(o) for o in config.get("overrides") or []]
    cfg = load_workflow_recipe(recipe, config.get("run"), overrides)
    plan = WorkflowPlan(run=cfg.run_name, recipe=recipe, overrides=overrides,
                        launcher=config.get("launcher", "auto"), cfg=cfg, epochs=plan_epochs(cfg),
                        recipe_files=recipe_chain(recipe))
    if config.get("branch_from"):
        _plan_branch(plan, str(config["branch_from"]).rstrip("/"))
    return plan


def _plan_branch(plan: WorkflowPlan, src: str) -> None:
    m = re.search(r"(?:^|/)([^/]+)/epoch_([1-9][0-9]*)$", src)
    if not m:
        raise RecipeError.single("branch_from", src, "an epoch directory of another run, results/<run>/epoch_<k>",
                                 "point branch_from at e.g. results/tiny-addition/epoch_1.", SOURCE)
    src_run, k = m.group(1), int(m.group(2))
    if src_run == plan.run:
        raise RecipeError.single("branch_from", src, f"an epoch of another run than `run` ({plan.run})",
                                 "give the branch its own run name (--config run=<new name>).", SOURCE)
    manifest = Path(src) / "checkpoint" / "manifest.json"
    if not manifest.is_file():
        raise RecipeError.single("branch_from", src, f"a finished epoch ({manifest} is missing)",
                                 f"train that epoch first, or branch from an earlier one.", SOURCE)
    init = Path(src).parent / "init_policy" / "model.safetensors"
    if not init.is_file():
        raise RecipeError.single("branch_from", src, f"an epoch of a run that kept its initial policy ({init} is "
                                 "missing; a branch links it instead of building its own)",
                                 "branch from a run whose results/<run>/init_policy/ is complete, or rebuild "
                                 "it there first (snakemake ... <that run's>/init_policy).", SOURCE)
    if k >= plan.num_epochs:
        raise RecipeError.single("branch_from", src,
                                 f"an epoch before this run's last one (the recipe plans {plan.num_epochs} epochs)",
                                 "branch from an earlier epoch, or raise grpo.max_num_epochs / max_num_steps "
                                 "in `overrides`.", SOURCE)
    plan.branch_from, plan.branch_epoch = src, k


def stage_config(smk: Any) -> str:
    """The resolved recipe a stage job runs with, resolved from the invocation's workflow config
    (`recipe`, `run`, `overrides`, as the parse did), written once under a content-addressed
    name (results/<run>/.stage-digests/config-<hash>.json, never rewritten) and returned as a path.

    Stage jobs do not read results/<run>/resolved_config.json: the rule that writes it
    (validate_recipe) must not be upstream of the stages, or Snakemake would skip their change
    checks whenever it reruns (see write_stage_digests). A content-addressed file cannot change
    under a running job, whatever another snakemake invocation (a dry run too) plans meanwhile."""
    import hashlib
    import json

    from rl_core.fsutil import atomic_write_text
    from rl_core.launch.stages import load_workflow_recipe

    conf = smk.config
    cfg = load_workflow_recipe(conf["recipe"], conf.get("run"), [str(o) for o in conf.get("overrides") or []])
    text = json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n"
    path = Path(f"results/{cfg.run_name}/.stage-digests/config-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json")
    if not path.is_file() or path.read_text() != text:
        atomic_write_text(path, text)
    return str(path)


_terminal: Callable[[str], None] | None = None  # set while a rule's stage runs (run_in_rule)


def tell_terminal(text: str) -> None:
    """One progress line on snakemake's terminal (not only in the rule's log); no-op outside a rule."""
    if _terminal is not None:
        _terminal(text)


def run_in_rule(smk: Any, fn: Callable[[], Any], append_log: bool = False) -> None:
    """Run a stage inside a rule's script: output into `smk.log[0]`, clean errors on the terminal."""
    log_path = Path(smk.log[0])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.dup(2)
    log = open(log_path, "a" if append_log else "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    rule = getattr(smk, "rule", "rule")
    print(f"=== {rule} {dict(smk.wildcards)} started {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}",
          flush=True)

    def tell(text: str) -> None:
        os.write(terminal, (text.rstrip() + "\n").encode())

    global _terminal
    _terminal = tell
    try:
        fn()
    except UserError as exc:
        if exc.__cause__ is not None:  # a run's failure (a user's agent raised...): its traceback, in the log only
            traceback.print_exc()
        print(f"{rule}: {exc}", flush=True)
        tell(f"\n{rule}: {exc}\n(log: {log_path})")
        sys.stdout.flush()
        os._exit(exc.exit_code)
    except BaseException as exc:  # noqa: BLE001 - reported in one line, traceback in the log
        traceback.print_exc()
        sys.stderr.flush()
        tell(f"\n{rule}: failed with {type(exc).__name__}: {exc} (traceback in {log_path})")
        os._exit(1 if not isinstance(exc, SystemExit) or not isinstance(exc.code, int) else exc.code)
    print(f"=== {rule} done {time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    sys.stdout.flush()


def final_summary(plan: WorkflowPlan) -> str | None:
    """What a finished run prints last (snakemake's onsuccess): accuracy before/after RL, the report."""
    import json

    def acc(path: str) -> float | None:
        try:
            return float(json.loads(Path(path).read_text())["accuracy"])
        except (OSError, ValueError, KeyError):
            return None

    before = acc(f"{plan.run_dir}/init_validation.json")
    after = acc(f"{plan.epoch_dir(plan.num_epochs)}/validation.json")
    if before is None or after is None or not Path(plan.report).is_file():
        return None
    steps = plan.epochs[-1]["end_step"]
    return (f"held-out accuracy: {before:.3f} before RL -> {after:.3f} after {steps} RL steps "
            f"({(after - before) * 100:+.1f} points)\nreport: {plan.report}")
