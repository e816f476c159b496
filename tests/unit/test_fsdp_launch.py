"""Launching the multi-process trainers: who is who (torchrun, a Slurm step, one process),
Slurm host lists, and the placement checks that stop a bad launch or recipe before any
model is built, each naming the field, the value, what was expected and the fix."""

from __future__ import annotations

import pytest

from rl_core.config import apply_overrides, validate_dict
from rl_core.errors import RecipeError
from rl_core.distributed import check_world, detect_env, expand_nodelist


def cfg(*overrides: str):
    return validate_dict(apply_overrides({}, list(overrides)))


def test_expand_nodelist():
    assert expand_nodelist("gpu[01-03,7],login-a") == ["gpu01", "gpu02", "gpu03", "gpu7", "login-a"]
    assert expand_nodelist("n[1-2]-ib[3-4]") == ["n1-ib3", "n1-ib4", "n2-ib3", "n2-ib4"]
    assert expand_nodelist("a,b,c[9-11]") == ["a", "b", "c9", "c10", "c11"]


def test_detect_env_torchrun_slurm_and_single():
    t = detect_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "h0", "MASTER_PORT": "1234", "SLURM_STEP_NUM_TASKS": "9", "SLURM_PROCID": "0"})
    assert (t.source, t.rank, t.world_size, t.local_rank, t.master_addr, t.master_port, t.num_nodes) == \
        ("torchrun", 3, 4, 1, "h0", 1234, 2)
    slurm = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "2",
             "SLURM_STEP_NODELIST": "node[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "4242",
             "SLURM_STEP_ID": "1"}
    s = detect_env(slurm)
    assert (s.source, s.rank, s.world_size, s.local_rank, s.local_world_size, s.master_addr, s.num_nodes) == \
        ("slurm", 2, 4, 0, 2, "node07", 2)
    assert detect_env({**slurm, "SLURM_PROCID": "0"}).master_port == s.master_port  # every task agrees
    assert detect_env({**slurm, "SLURM_STEP_ID": "2"}).master_port != s.master_port  # the next step differs
    sub = detect_env({"SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1",
                      "SUBMITIT_LOCAL_JOB_ID": "777"})
    assert (sub.source, sub.rank, sub.world_size, sub.master_addr) == ("submitit-local", 1, 2, "127.0.0.1")
    # a batch script (no job step) is one process even when the allocation has 8 tasks
    b = detect_env({"SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_JOB_ID": "1"})
    assert (b.source, b.world_size) == ("single", 1)


def _env(world: int, local_rank: int = 0):
    return detect_env({"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank)})


def test_check_world_rejects_a_launch_that_does_not_fit():
    with pytest.raises(RecipeError, match=r"`trainer.backend` got 'torch'.*torchrun started 2 processes"):
        check_world(cfg(), _env(2), "cpu")
    with pytest.raises(RecipeError, match="`trainer.megatron.tensor_model_parallel_size` got 2.*3 processes"):
        check_world(cfg("trainer.backend=megatron", "trainer.megatron.tensor_model_parallel_size=2"), _env(3), "cpu")
    two = cfg("trainer.backend=fsdp2", "cluster.trainer.num_processes_per_node=2", "cluster.controller.tasks_per_node=2")
    check_world(two, _env(2), "cpu")
    with pytest.raises(RecipeError, match="`cluster.trainer`.*2 trainer processes, as torchrun launched 4"):
        check_world(two, _env(4), "cpu")
    gpu = cfg("trainer.backend=fsdp2")
    with pytest.raises(RecipeError, match="local rank 1 but only 1 visible GPU"):
        check_world(gpu, _env(2, local_rank=1), "cuda", num_visible_gpus=1)


def test_recipe_placement_rules_fail_at_load():
    with pytest.raises(RecipeError, match="`cluster.trainer`.*one process for trainer.backend 'torch'"):
        cfg("cluster.trainer.num_processes_per_node=2", "cluster.controller.tasks_per_node=2")
    with pytest.raises(RecipeError, match="`trainer.fsdp.data_parallel_replicate_size` got 2.*3 processes"):
        cfg("trainer.backend=fsdp2", "trainer.fsdp.data_parallel_replicate_size=2",
            "cluster.trainer.num_processes_per_node=3", "cluster.controller.tasks_per_node=3")
    with pytest.raises(RecipeError, match="`cluster.trainer`.*fits in the controller job"):
        cfg("trainer.backend=fsdp2", "cluster.trainer.num_gpus_per_node=4")
    with pytest.raises(RecipeError, match="`cluster.trainer.num_processes_per_node` got 2.*one trainer process per GPU"):
        cfg("trainer.backend=fsdp2", "cluster.trainer.num_gpus_per_node=4", "cluster.trainer.num_processes_per_node=2")
    with pytest.raises(RecipeError, match="`trainer.fsdp.mixed_precision` got 'bf16'.*needs CUDA"):
        cfg("trainer.backend=fsdp2", "trainer.fsdp.mixed_precision=bf16", "runtime.device=cpu")
    with pytest.raises(RecipeError, match="`trainer.megatron.pipeline_model_parallel_size` got 2"):
        cfg("trainer.backend=megatron", "trainer.megatron.pipeline_model_parallel_size=2")
    with pytest.raises(RecipeError, match="`trainer.megatron.mixed_precision` got 'bf16'.*fp32 master"):
        cfg("trainer.backend=megatron", "trainer.megatron.optimizer=torch", "trainer.megatron.mixed_precision=bf16")
    with pytest.raises(RecipeError, match="`trainer.megatron.fused_elementwise` got 'on'.*compile true"):
        cfg("trainer.backend=megatron", "trainer.megatron.compile=true", "trainer.megatron.fused_elementwise=on")
    with pytest.raises(RecipeError, match="`cluster.generation`.*colocated"):
        cfg("cluster.generation.num_gpus_per_node=1")
    ok = cfg("trainer.backend=megatron", "trainer.megatron.tensor_model_parallel_size=2",
             "cluster.trainer.num_gpus_per_node=4", "cluster.controller.gpus_per_node=4",
             "cluster.controller.tasks_per_node=4")
    assert ok.cluster.trainer.world_size == 4
