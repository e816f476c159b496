"""Rules validate_epoch / validate_init: held-out validation of one checkpoint."""
from rl_core.launch import stages
from rl_core.launch.workflow import run_in_rule, stage_config

smk = snakemake  # noqa: F821 - injected by Snakemake
run_in_rule(smk, lambda: stages.validate_checkpoint(stage_config(smk), smk.input.checkpoint, smk.output[0]))
