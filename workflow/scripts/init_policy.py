"""Rule init_policy: the initial policy (tiny model + warm-up, or an imported HF model)."""
from rl_core.launch import stages
from rl_core.launch.workflow import run_in_rule, stage_config

smk = snakemake  # noqa: F821 - injected by Snakemake
run_in_rule(smk, lambda: stages.init_policy(stage_config(smk), smk.output[0]))
