# The final and the best (by validation accuracy) checkpoints x the recipe's eval sets, as
# one submitit job array (rl_core.launch.evaluate); the rule submits and waits.


rule evaluate:
    localrule: True
    input:
        config=ancient(WF.resolved),
        checkpoints=WF.per_epoch("checkpoint"),
        validations=WF.per_epoch("validation.json"),
    output:
        WF.evaluation,
    params:
        epochs=[e["epoch"] for e in WF.epochs],
        recipe_digest=WF.digest("evaluate"),
    threads: 2
    resources:
        # a resource, not a param: where the job runs must not trigger a rerun
        launcher=lambda wc: WF.job_launcher(workflow.executor_plugin),
    conda:
        "../envs/rl_core.yaml"
    log:
        f"{WF.run_dir}/logs/evaluate.log",
    script:
        "../scripts/evaluate.py"
