# rl_core workflow: validate_recipe -> init_policy -> train_epoch (one per epoch, a submitit
# controller job) -> archive_rollouts / validate_epoch -> evaluate -> report.
#   snakemake --cores 2                          the embedded default (config/config.yaml)
#   snakemake --profile profiles/slurm           the same on Slurm
# Stages, outputs and rerun recipes: docs/workflow.md.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


# `snakemake --report report.html` (or report.zip): the run's plots, report.html, validation
# and evaluation results, with the rules, their runtimes and the software stack.
report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/branch.smk"
include: "workflow/rules/validate.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    localrule: True
    input:
        WF.report,
        WF.resolved,


onsuccess:
    from rl_core.launch.workflow import final_summary

    if (line := final_summary(WF)) is not None:
        print(line)
