"""Rule make_data: the recipe's `data.generate` files (a reasoning_gym task's train and held-out sets)."""
from rl_core.launch import stages
from rl_core.launch.workflow import run_in_rule, stage_config

smk = snakemake  # noqa: F821 - injected by Snakemake
run_in_rule(smk, lambda: stages.make_data(stage_config(smk)))
