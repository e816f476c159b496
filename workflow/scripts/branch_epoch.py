"""Rule branch_epoch: an epoch of another run, linked into this run (branch_from)."""
from rl_core.launch.branch import branch_epoch
from rl_core.launch.workflow import run_in_rule

smk = snakemake  # noqa: F821 - injected by Snakemake
run_in_rule(smk, lambda: branch_epoch(smk.params.src, smk.params.dst))
