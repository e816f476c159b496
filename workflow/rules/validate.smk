# Held-out validation of every epoch's checkpoint (and of the initial policy, as the
# "before RL" baseline), with the recipe's `validation` sampling knobs.


rule validate_init:
    input:
        config=ancient(WF.resolved),
        checkpoint=WF.init_policy,
    output:
        f"{WF.run_dir}/init_validation.json",
    params:
        recipe_digest=WF.digest("validate"),
    conda:
        "../envs/rl_core.yaml"
    log:
        f"{WF.run_dir}/logs/validate_init.log",
    script:
        "../scripts/validate_checkpoint.py"


rule validate_epoch:
    input:
        config=ancient(WF.resolved),
        checkpoint=f"{WF.run_dir}/epoch_{{epoch}}/checkpoint",
    output:
        f"{WF.run_dir}/epoch_{{epoch}}/validation.json",
    params:
        recipe_digest=WF.digest("validate"),
    conda:
        "../envs/rl_core.yaml"
    log:
        f"{WF.run_dir}/logs/validate_epoch_{{epoch}}.log",
    script:
        "../scripts/validate_checkpoint.py"
