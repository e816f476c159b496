# results/<run>/report.html (plots embedded) and results/<run>/report/*.png.


rule report:
    input:
        summaries=WF.per_epoch("summary.json"),
        validations=WF.per_epoch("validation.json"),
        rollouts=WF.per_epoch("rollouts.h5"),
        init_validation=f"{WF.run_dir}/init_validation.json",
        evaluation=WF.evaluation,
    output:
        html=WF.report,
        plots=WF.plots(),
    params:
        run_dir=lambda wc, output: str(Path(output.html).parent),
    conda:
        "../envs/rl_core.yaml"
    log:
        f"{WF.run_dir}/logs/report.log",
    script:
        "../scripts/report.py"
