"""Rule train_epoch: one epoch as a submitit controller job (local process or Slurm)."""
from rl_core.launch.job import submit_train_epoch
from rl_core.launch.workflow import run_in_rule, stage_config

smk = snakemake  # noqa: F821 - injected by Snakemake
run_in_rule(smk, lambda: submit_train_epoch(stage_config(smk), int(smk.wildcards.epoch), smk.input.prev,
                                            smk.params.epoch_dir, smk.resources.launcher), append_log=True)
