# A branch (`branch_from: results/<source>/epoch_<k>`): epochs 1..k and the initial policy
# are the source run's, taken without changing anything of the source (rl_core/launch/branch.py
# says what is hard-linked and what is copied); the archive and validations of those epochs
# are the source's results, copied instead of recomputed, when they still hold.

if WF.branch_from:

    # The source run's initial policy (payload hard-linked, never rebuilt).
    rule branch_init_policy:
        localrule: True
        input:
            weights=WF.source_init_policy("model.safetensors"),
        output:
            directory(WF.init_policy),
        params:
            src=WF.source_init_policy(),
        conda:
            "../envs/rl_core.yaml"
        log:
            f"{WF.run_dir}/logs/branch_init_policy.log",
        script:
            "../scripts/branch_init_policy.py"

    rule branch_epoch:
        localrule: True
        input:
            manifest=lambda wc: f"{WF.source_epoch_dir(wc.epoch)}/checkpoint/manifest.json",
        output:
            checkpoint=directory(f"{WF.run_dir}/epoch_{{epoch}}/checkpoint"),
            summary=f"{WF.run_dir}/epoch_{{epoch}}/summary.json",
        params:
            src=lambda wc: WF.source_epoch_dir(wc.epoch),
            dst=lambda wc: WF.epoch_dir(wc.epoch),
        wildcard_constraints:
            epoch=WF.epoch_regex(WF.branched_epochs()),
        conda:
            "../envs/rl_core.yaml"
        log:
            f"{WF.run_dir}/logs/branch_epoch_{{epoch}}.log",
        script:
            "../scripts/branch_epoch.py"

    # A linked epoch's rollout archive: the source's (the same spool), not compiled again.
    rule branch_archive:
        localrule: True
        input:
            result=lambda wc: WF.source_result(f"epoch_{wc.epoch}/rollouts.h5"),
            summary=f"{WF.run_dir}/epoch_{{epoch}}/summary.json",
        output:
            f"{WF.run_dir}/epoch_{{epoch}}/rollouts.h5",
        wildcard_constraints:
            epoch=WF.epoch_regex(WF.reused_archives()),
        conda:
            "../envs/rl_core.yaml"
        log:
            f"{WF.run_dir}/logs/branch_archive_{{epoch}}.log",
        script:
            "../scripts/branch_reuse.py"

    # A linked epoch's validation: the source's, when it was made with this run's validation
    # knobs (the same digest) and is up to date there; else rule validate_epoch reruns it.
    rule branch_validation:
        localrule: True
        input:
            result=lambda wc: WF.source_result(f"epoch_{wc.epoch}/validation.json"),
            digest=WF.stage_digest("validate"),
            checkpoint=f"{WF.run_dir}/epoch_{{epoch}}/checkpoint",
        output:
            report(f"{WF.run_dir}/epoch_{{epoch}}/validation.json", caption="../report/validation.rst",
                   category="Validation", subcategory="epoch {epoch}"),
        wildcard_constraints:
            epoch=WF.epoch_regex(WF.reused_validations()),
        conda:
            "../envs/rl_core.yaml"
        log:
            f"{WF.run_dir}/logs/branch_validation_{{epoch}}.log",
        script:
            "../scripts/branch_reuse.py"

    if WF.reuses_init_validation():

        # preferred to validate_init (both can write init_validation.json; validate_init stays
        # defined as it was, so that runs made before this rule existed keep their validation)
        ruleorder: branch_init_validation > validate_init

        rule branch_init_validation:
            localrule: True
            input:
                result=WF.source_result("init_validation.json"),
                digest=WF.stage_digest("validate"),
                checkpoint=WF.init_policy,  # the branch's own (linked) initial policy, as validate_init
            output:
                report(f"{WF.run_dir}/init_validation.json", caption="../report/validation.rst",
                       category="Validation", subcategory="before RL"),
            conda:
                "../envs/rl_core.yaml"
            log:
                f"{WF.run_dir}/logs/branch_init_validation.log",
            script:
                "../scripts/branch_reuse.py"
