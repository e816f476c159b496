# results/<run>/report.html (plots embedded) and results/<run>/report/*.png.


rule report:
    input:
        summaries=WF.per_epoch("summary.json"),
        validations=WF.per_epoch("validation.json"),
        rollouts=WF.per_epoch("rollouts.h5"),
        init_validation=f"{WF.run_dir}/init_validation.json",
        evaluation=WF.evaluation,
    output:
        html=report(WF.report, caption="../report/report_html.rst", category="Report"),
        plots=report(WF.plots(), caption="../report/plot.rst", category="Plots"),
    params:
        run_dir=lambda wc, output: str(Path(output.html).parent),
    resources:
        mem_mb=2000,
        runtime=15,
    conda:
        "../envs/rl_core.yaml"
    log:
        f"{WF.run_dir}/logs/report.log",
    benchmark:
        f"{WF.run_dir}/benchmarks/report.tsv"
    script:
        "../scripts/report.py"
