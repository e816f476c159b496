"""Rule report: results/<run>/report.html with the PNG plots; with logging.tensorboard also the
before-RL and end-of-epoch validations as TensorBoard scalars (results/<run>/tensorboard/validation)."""
import json
from pathlib import Path

from rl_core.config import load_resolved
from rl_core.launch.stages import log_validations_tensorboard
from rl_core.launch.workflow import run_in_rule, stage_config
from rl_core.report import build_report

smk = snakemake  # noqa: F821 - injected by Snakemake


def report() -> None:
    print(build_report(smk.params.run_dir, smk.output.html, Path(smk.output.plots[0]).parent))
    if load_resolved(stage_config(smk)).logging.tensorboard:
        results = [json.loads(Path(p).read_text()) for p in [smk.input.init_validation, *smk.input.validations]]
        print(log_validations_tensorboard(results, Path(smk.params.run_dir) / "tensorboard" / "validation"))


run_in_rule(smk, report)
