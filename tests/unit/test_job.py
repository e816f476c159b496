"""submitit plumbing of the workflow: executors, waiting with log copying, failures, the lock.

The jobs here are real local submitit jobs running small stdlib / rl_core functions (the
controller job itself runs in tests/workflow)."""

from __future__ import annotations

import operator
import shutil
import signal

import pytest
import submitit
from submitit.slurm.slurm import _make_sbatch_string

from rl_core.config import read_recipe
from rl_core.launch.job import (JobError, TrainEpochJob, controller_lock, make_executor, read_lock,
                                slurm_parameters, stop_on_sigterm_locally, wait_for_jobs)
from rl_core.launch.branch import branch_epoch
from tests.helpers.jobs import sigterm_self_after_install, worker_task_dies


@pytest.fixture(scope="module")
def cluster():
    return read_recipe("recipes/tiny-addition.yaml").cluster


def test_local_executor_is_explicit_and_gets_the_time_limit(tmp_path, cluster, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    ex = make_executor("local", tmp_path, cluster.controller, cluster, "n")
    assert isinstance(ex, submitit.LocalExecutor)
    assert ex.parameters["timeout_min"] == cluster.controller.timeout_min
    assert ex.parameters["signal_delay_s"] == cluster.controller.signal_delay_s
    assert ex.parameters["gpus_per_node"] == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    ex = make_executor("local", tmp_path, cluster.controller, cluster, "n")
    assert ex.parameters["visible_gpus"] == (2, 3) and ex.parameters["gpus_per_node"] == 2


def test_slurm_executor_takes_the_recipe_resources(tmp_path):
    cfg = read_recipe("recipes/tiny-addition.yaml", [
        "cluster.controller.partition=gpu", "cluster.controller.gpus_per_node=4", "cluster.controller.mem_gb=64",
        "cluster.controller.timeout_min=240", "cluster.controller.extra_sbatch={reservation: big}"])
    p = slurm_parameters(cfg.cluster.controller, cfg.cluster, "rl_core-train")
    assert (p["partition"], p["gpus_per_node"], p["mem"], p["time"]) == ("gpu", 4, "65536M", 240)
    assert p["job_name"] == "rl_core-train" and p["additional_parameters"] == {"reservation": "big"}
    sbatch = _make_sbatch_string(command="python job.py", folder=tmp_path, **p)
    assert "#SBATCH --partition=gpu" in sbatch and "#SBATCH --gpus-per-node=4" in sbatch
    assert "#SBATCH --signal=USR2@90" in sbatch and "#SBATCH --reservation=big" in sbatch
    assert "#SBATCH --mem=65536M" in sbatch and "#SBATCH --time=240" in sbatch
    assert "gpus_per_node" not in slurm_parameters(cfg.cluster.evaluation, cfg.cluster, "e")
    with pytest.raises(JobError, match="launcher"):
        make_executor("pbs", tmp_path, cfg.cluster.controller, cfg.cluster, "n")
    if shutil.which("srun") is None:
        with pytest.raises(JobError, match="launcher 'slurm' needs Slurm's commands"):
            make_executor("slurm", tmp_path, cfg.cluster.controller, cfg.cluster, "n")
    else:
        assert isinstance(make_executor("slurm", tmp_path, cfg.cluster.controller, cfg.cluster, "n"),
                          submitit.SlurmExecutor)


def test_wait_copies_the_job_log_and_returns_results(tmp_path, cluster, capsys):
    ex = make_executor("local", tmp_path, cluster.evaluation, cluster, "t")
    jobs = [ex.submit(operator.add, 2, 3), ex.submit(print, "hello from the job")]
    assert wait_for_jobs(jobs, "test", poll_interval_s=0.2, prefixes=["[a] ", "[b] "]) == [5, None]
    assert "[b] hello from the job" in capsys.readouterr().out


def test_a_user_error_in_the_job_is_one_paragraph(tmp_path, cluster):
    ex = make_executor("local", tmp_path, cluster.evaluation, cluster, "t")
    job = ex.submit(branch_epoch, str(tmp_path / "nowhere" / "epoch_1"), str(tmp_path / "dst"))
    with pytest.raises(JobError) as info:
        wait_for_jobs([job], "Branching", poll_interval_s=0.2)
    msg = str(info.value)
    assert msg.startswith("Branching (job ") and "nowhere/epoch_1/checkpoint/manifest.json is missing" in msg
    assert "Traceback" not in msg


def test_a_killed_job_says_how_to_resume(tmp_path, cluster):
    ex = make_executor("local", tmp_path, cluster.evaluation, cluster, "t")
    job = ex.submit(signal.raise_signal, signal.SIGKILL)
    with pytest.raises(JobError, match="ended without a result.*rerun the same command"):
        wait_for_jobs([job], "Training epoch 1", poll_interval_s=0.2)


def test_a_killed_local_job_is_reported_at_once(tmp_path, cluster):
    # its process has exited, so no result file will appear: no wait for one (submitit's
    # results() and exception() would each wait 15 s for it, as on a cluster's shared file system)
    import time

    ex = make_executor("local", tmp_path, cluster.evaluation, cluster, "t")
    job = ex.submit(signal.raise_signal, signal.SIGKILL)
    while not job.done():
        time.sleep(0.05)
    t0 = time.monotonic()
    with pytest.raises(JobError, match="ended without a result"):
        wait_for_jobs([job], "Training epoch 1", poll_interval_s=0.2)
    assert time.monotonic() - t0 < 10


def test_a_worker_task_killed_under_a_driver_that_finished_does_not_fail_the_job(tmp_path, cluster):
    """trainer.recovery replaces a killed worker rank in the job: task 1 leaves no result, task 0's
    (the driver's summary) is the job's result."""
    ex = make_executor("local", tmp_path, cluster.evaluation, cluster, "t")
    ex.update_parameters(tasks_per_node=2)
    job = ex.submit(worker_task_dies, 7)
    assert wait_for_jobs([job], "Training epoch 1", poll_interval_s=0.2) == [7]


def test_a_local_controller_job_stops_on_a_plain_kill(tmp_path, cluster):
    """submitit only logs "Bypassing signal SIGTERM"; the controller job's own handler stops it
    (docs/workflow.md, Recovery: `kill <pid>` of a local controller job). Not under Slurm."""
    ex = make_executor("local", tmp_path, cluster.evaluation, cluster, "t")
    job = ex.submit(sigterm_self_after_install)
    with pytest.raises(JobError, match="ended without a result"):
        wait_for_jobs([job], "Training epoch 1", poll_interval_s=0.2)
    assert "SIGTERM: stopping now" in job.stdout()
    assert not stop_on_sigterm_locally()  # this test process is no submitit job


def test_one_controller_per_epoch_dir(tmp_path):
    with controller_lock(tmp_path):
        assert read_lock(tmp_path)["pid"] > 0
        with pytest.raises(JobError, match=r"in use by another controller \(\{\"pid\""):
            with controller_lock(tmp_path):
                pass
    with controller_lock(tmp_path):  # released with the first holder
        pass


def test_checkpoint_resubmits_the_same_call():
    args = ("results/r/resolved_config.json", 2, "results/r/epoch_1/checkpoint", "results/r/epoch_2")
    delayed = TrainEpochJob().checkpoint(*args)
    assert isinstance(delayed.function, TrainEpochJob) and delayed.args == args and delayed.kwargs == {}


def test_local_launcher_refuses_what_it_cannot_honour(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cfg = read_recipe("recipes/tiny-addition.yaml", ["cluster.controller.nodes=2"])
    with pytest.raises(JobError, match=r"cluster.controller.nodes is 2 but the local launcher"):
        make_executor("local", tmp_path, cfg.cluster.controller, cfg.cluster, "n")
    cfg = read_recipe("recipes/tiny-addition.yaml", ["cluster.evaluation.gpus_per_node=4"])
    with pytest.raises(JobError, match=r"cluster.evaluation.gpus_per_node is 4 but this machine has 1 usable GPU"):
        make_executor("local", tmp_path, cfg.cluster.evaluation, cfg.cluster, "n")


def test_a_crash_in_the_job_names_the_exception(tmp_path, cluster):
    ex = make_executor("local", tmp_path, cluster.evaluation, cluster, "t")
    job = ex.submit(operator.truediv, 1, 0)
    with pytest.raises(JobError, match=r"^Crash \(job \d+\) failed: ZeroDivisionError: division by zero\. Its log: "):
        wait_for_jobs([job], "Crash", poll_interval_s=0.2)
