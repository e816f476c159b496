"""Rules validate_epoch / validate_init: held-out validation of one checkpoint (validation.json,
and with logging.tensorboard the scalars in results/<run>/tensorboard/validation at the RL step)."""
from rl_core.launch import stages
from rl_core.launch.workflow import run_in_rule, stage_config

smk = snakemake  # noqa: F821 - injected by Snakemake
name = f"epoch_{smk.wildcards.epoch}" if "epoch" in smk.wildcards.keys() else "init"
run_in_rule(smk, lambda: stages.validate_checkpoint(stage_config(smk), smk.input.checkpoint, smk.output[0],
                                                    tensorboard_dir=f"results/{smk.config['run']}/tensorboard/validation",
                                                    tensorboard_name=name))
