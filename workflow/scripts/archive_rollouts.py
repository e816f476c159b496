"""Rule archive_rollouts: an epoch's rollout spool -> rollouts.h5 (inspect with `rl-core inspect`)."""
from rl_core.archive import compile_spool
from rl_core.launch.workflow import run_in_rule

smk = snakemake  # noqa: F821 - injected by Snakemake
run_in_rule(smk, lambda: print(compile_spool(smk.params.spool, smk.output[0],
                                             attrs={"run": smk.params.run, "epoch": int(smk.wildcards.epoch)})))
