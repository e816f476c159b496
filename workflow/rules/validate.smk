# Held-out validation of every epoch's checkpoint (and of the initial policy, as the
# "before RL" baseline), with the recipe's `validation` sampling knobs.


rule validate_init:
    input:
        digest=WF.stage_digest("validate"),
        data=WF.data_inputs("validate"),
        checkpoint=WF.init_policy,
    output:
        report(f"{WF.run_dir}/init_validation.json", caption="../report/validation.rst", category="Validation",
               subcategory="before RL"),
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        "../envs/rl_core.yaml"
    log:
        f"{WF.run_dir}/logs/validate_init.log",
    benchmark:
        f"{WF.run_dir}/benchmarks/validate_init.tsv"
    script:
        "../scripts/validate_checkpoint.py"


rule validate_epoch:
    input:
        digest=WF.stage_digest("validate"),
        data=WF.data_inputs("validate"),
        checkpoint=f"{WF.run_dir}/epoch_{{epoch}}/checkpoint",
    output:
        report(f"{WF.run_dir}/epoch_{{epoch}}/validation.json", caption="../report/validation.rst",
               category="Validation", subcategory="epoch {epoch}"),
    wildcard_constraints:
        epoch=WF.epoch_regex(WF.epochs_but(WF.reused_validations())),
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        "../envs/rl_core.yaml"
    log:
        f"{WF.run_dir}/logs/validate_epoch_{{epoch}}.log",
    benchmark:
        f"{WF.run_dir}/benchmarks/validate_epoch_{{epoch}}.tsv"
    script:
        "../scripts/validate_checkpoint.py"
