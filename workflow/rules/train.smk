# One epoch = one submitit controller job (rl_core.launch.job). The rule itself only submits
# and waits (a local rule, also on Slurm); the job resumes from its step checkpoints.


rule train_epoch:
    localrule: True
    input:
        digest=WF.stage_digest("train"),
        data=WF.data_inputs("train"),
        prev=lambda wc: WF.prev_checkpoint(wc.epoch),
    output:
        checkpoint=directory(f"{WF.run_dir}/epoch_{{epoch}}/checkpoint"),
        summary=f"{WF.run_dir}/epoch_{{epoch}}/summary.json",
    params:
        epoch_dir=lambda wc: WF.epoch_dir(wc.epoch),
    wildcard_constraints:
        epoch=WF.epoch_regex(WF.trained_epochs()),
    threads: 2
    resources:
        # a resource, not a param: where the job runs must not trigger a rerun
        launcher=lambda wc: WF.job_launcher(workflow.executor_plugin),
    conda:
        "../envs/rl_core.yaml"
    log:
        f"{WF.run_dir}/logs/train_epoch_{{epoch}}.log",
    benchmark:
        f"{WF.run_dir}/benchmarks/train_epoch_{{epoch}}.tsv"
    script:
        "../scripts/train_epoch.py"


rule archive_rollouts:
    input:
        summary=f"{WF.run_dir}/epoch_{{epoch}}/summary.json",
    output:
        f"{WF.run_dir}/epoch_{{epoch}}/rollouts.h5",
    params:
        spool=lambda wc: f"{WF.epoch_dir(wc.epoch)}/rollouts.spool",
        run=WF.run,
    wildcard_constraints:
        epoch=WF.epoch_regex(WF.epochs_but(WF.reused_archives())),
    resources:
        mem_mb=2000,
        runtime=15,
    conda:
        "../envs/rl_core.yaml"
    log:
        f"{WF.run_dir}/logs/archive_rollouts_{{epoch}}.log",
    benchmark:
        f"{WF.run_dir}/benchmarks/archive_rollouts_{{epoch}}.tsv"
    script:
        "../scripts/archive_rollouts.py"
