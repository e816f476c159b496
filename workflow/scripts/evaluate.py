"""Rule evaluate: final and best checkpoints x eval sets, as a submitit job array."""
from rl_core.launch.evaluate import run_evaluation
from rl_core.launch.workflow import run_in_rule, stage_config

smk = snakemake  # noqa: F821 - injected by Snakemake
epochs = {k: {"checkpoint": c, "validation": v}
          for k, c, v in zip(smk.params.epochs, smk.input.checkpoints, smk.input.validations)}
run_in_rule(smk, lambda: run_evaluation(stage_config(smk), epochs, smk.output[0], smk.resources.launcher))
