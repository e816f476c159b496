"""Rule report: results/<run>/report.html with the PNG plots and the recipe (its files, the
overrides, the resolved recipe); with logging.trackers also the before-RL and end-of-epoch
validations as tracker scalars (TensorBoard: results/<run>/tensorboard/validation;
W&B and MLflow: the run <run_name>/validation)."""
import json
from pathlib import Path

from rl_core.config import load_resolved
from rl_core.launch.stages import log_validations
from rl_core.launch.workflow import recipe_chain, run_in_rule, stage_config
from rl_core.report import RecipeShown, build_report

smk = snakemake  # noqa: F821 - injected by Snakemake


def report() -> None:
    resolved = stage_config(smk)
    # the workflow config of this invocation: read here, not as params, so that a change the
    # report does not depend on (`cluster:`, `logging`) reruns no report (docs/workflow.md)
    recipe = smk.config["recipe"]
    shown = RecipeShown(path=recipe, overrides=[str(o) for o in smk.config.get("overrides") or []],
                        files={p: Path(p).read_text() for p in recipe_chain(recipe)},
                        resolved=Path(resolved).read_text())
    print(build_report(smk.params.run_dir, smk.output.html, Path(smk.output.plots[0]).parent, recipe=shown))
    cfg = load_resolved(resolved)
    if cfg.logging.trackers:
        results = [json.loads(Path(p).read_text()) for p in [smk.input.init_validation, *smk.input.validations]]
        for line in log_validations(results, cfg, smk.params.run_dir):
            print(line)


run_in_rule(smk, report)
