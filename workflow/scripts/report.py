"""Rule report: results/<run>/report.html with the PNG plots."""
from pathlib import Path

from rl_core.launch.workflow import run_in_rule
from rl_core.report import build_report

smk = snakemake  # noqa: F821 - injected by Snakemake
run_in_rule(smk, lambda: print(build_report(smk.params.run_dir, smk.output.html,
                                            Path(smk.output.plots[0]).parent)))
