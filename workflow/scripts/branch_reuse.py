"""Rules branch_archive / branch_validation / branch_init_validation: a linked epoch's result,
the source run's, reused (copied) instead of recomputed."""
from rl_core.launch.branch import reuse_result
from rl_core.launch.workflow import run_in_rule

smk = snakemake  # noqa: F821 - injected by Snakemake
run_in_rule(smk, lambda: reuse_result(smk.input.result, smk.output[0]))
