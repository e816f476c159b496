# The final and the best (by validation accuracy) checkpoints x the recipe's eval sets, as
# one submitit job array (rl_core.launch.evaluate); the rule submits and waits.


rule evaluate:
    localrule: True
    input:
        digest=WF.stage_digest("evaluate"),
        data=WF.data_inputs("evaluate"),
        checkpoints=WF.per_epoch("checkpoint"),
        validations=WF.per_epoch("validation.json"),
    output:
        report(WF.evaluation, caption="../report/evaluation.rst", category="Evaluation"),
    params:
        epochs=[e["epoch"] for e in WF.epochs],
    threads: 2
    resources:
        # a resource, not a param: where the job runs must not trigger a rerun
        launcher=lambda wc: WF.job_launcher(workflow.executor_plugin),
    conda:
        "../envs/rl_core.yaml"
    log:
        f"{WF.run_dir}/logs/evaluate.log",
    benchmark:
        f"{WF.run_dir}/benchmarks/evaluate.tsv"
    script:
        "../scripts/evaluate.py"
