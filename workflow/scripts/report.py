"""Rule report: results/<run>/report.html with the PNG plots; with logging.trackers also the
before-RL and end-of-epoch validations as tracker scalars (TensorBoard: results/<run>/tensorboard/validation;
W&B and MLflow: the run <run_name>/validation)."""
import json
from pathlib import Path

from rl_core.config import load_resolved
from rl_core.launch.stages import log_validations
from rl_core.launch.workflow import run_in_rule, stage_config
from rl_core.report import build_report

smk = snakemake  # noqa: F821 - injected by Snakemake


def report() -> None:
    print(build_report(smk.params.run_dir, smk.output.html, Path(smk.output.plots[0]).parent))
    cfg = load_resolved(stage_config(smk))
    if cfg.logging.trackers:
        results = [json.loads(Path(p).read_text()) for p in [smk.input.init_validation, *smk.input.validations]]
        for line in log_validations(results, cfg, smk.params.run_dir):
            print(line)


run_in_rule(smk, report)
