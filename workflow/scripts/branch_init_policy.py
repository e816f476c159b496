"""Rule branch_init_policy: a branch run's initial policy is its source run's (linked, not rebuilt)."""
from rl_core.launch.branch import link_init_policy
from rl_core.launch.workflow import run_in_rule

smk = snakemake  # noqa: F821 - injected by Snakemake
run_in_rule(smk, lambda: link_init_policy(smk.params.src, smk.output[0]))
