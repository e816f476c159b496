"""Node groups across nodes, without a cluster: the recipe rules of `cluster.generation`, the
controller job's one allocation (sbatch asks for the trainer's and the generation nodes,
submitit's step runs the trainer on the first), which nodes the generation servers get, and
the `srun` command line and environment of a server started as a job step."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_core.config import apply_overrides, validate_dict
from rl_core.launch.preflight import load_recipe
from rl_core.errors import RecipeError
from rl_core.generation.http.servers import CONTROL_SECRET_ENV, TOKEN_ENV, EngineArgs
from rl_core.generation.http.slurm_servers import SlurmServer, generation_nodes, slurm_servers
from rl_core.launch.job import slurm_parameters

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-addition-multinode.yaml"
HTTP = ["generation.backend=http", "generation.placement=separate"]


def cfg(*overrides: str):
    return validate_dict(apply_overrides({}, list(overrides)))


def test_generation_group_rules_fail_at_load():
    group = [*HTTP, "generation.http.num_local_servers=2", "cluster.generation.num_nodes=2",
             "cluster.controller.nodes=3"]
    assert cfg(*group).cluster.generation.world_size == 2
    with pytest.raises(RecipeError, match="`generation.http.num_local_servers` got 1; expected 2: one rl-core serve"):
        cfg(*group, "generation.http.num_local_servers=1")
    with pytest.raises(RecipeError, match="`cluster.controller.nodes` got 2; expected at least 3.*set "
                                          "cluster.controller.nodes: 3"):
        cfg(*group, "cluster.controller.nodes=2")
    with pytest.raises(RecipeError, match="`cluster.generation`.*generation.http.urls are placed by whoever"):
        cfg(*HTTP, "generation.http.urls=[http://a:1]", "cluster.generation.num_nodes=1", "cluster.controller.nodes=2")
    with pytest.raises(RecipeError, match="`cluster.generation`.*backend 'vllm', whose server runs on the controller"):
        cfg("generation.backend=vllm", "generation.placement=separate", "cluster.generation.num_nodes=1",
            "cluster.controller.nodes=2")
    with pytest.raises(RecipeError, match="`cluster.generation`.*nodes fit the controller job's"):
        cfg(*group, "cluster.generation.num_processes_per_node=2", "generation.http.num_local_servers=4")


def test_the_controller_job_holds_trainer_and_generation_nodes_and_its_step_the_trainer():
    from submitit.slurm.slurm import _make_sbatch_string

    recipe = load_recipe(str(RECIPE))
    c = recipe.cluster
    params = slurm_parameters(c.controller, c, "rl_core-train-x-e1")
    # submitit counts the tasks of its own step (nodes x ntasks_per_node): the trainer group's
    assert params["nodes"] * params["ntasks_per_node"] == c.trainer.world_size == 2
    script = _make_sbatch_string(command="python -m submitit.core._submit F", folder="/tmp/f", **params)
    assert "#SBATCH --nodes=3\n" in script and "#SBATCH --partition=nodes\n" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--nodes=2 --ntasks=2 --ntasks-per-node=1" in srun
    # without a generation group the step is the whole allocation, as before
    plain = load_recipe(str(RECIPE), ["cluster.generation=null", "generation.http.num_local_servers=1"])
    p = slurm_parameters(plain.cluster.controller, plain.cluster, "x")
    assert p["nodes"] == 3 and "srun_args" not in p and "additional_parameters" not in p
    # the evaluation array is never split
    assert "srun_args" not in slurm_parameters(c.evaluation, c, "x")


def test_generation_nodes_are_the_allocation_minus_the_trainer_step():
    recipe = load_recipe(str(RECIPE))
    step = {"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_STEP_NODELIST": "node[1-2]"}
    assert generation_nodes(recipe, step) == ["node3"]
    assert generation_nodes(recipe, {}) is None  # outside Slurm: local servers
    with pytest.raises(RecipeError, match="`cluster.generation.num_nodes` got 1.*cluster.controller.nodes >= 3"):
        generation_nodes(recipe, {**step, "SLURM_JOB_NODELIST": "node[1-2]"})


def test_a_server_job_step_on_its_node(tmp_path, monkeypatch):
    recipe = load_recipe(str(RECIPE))
    monkeypatch.setenv("SLURM_NTASKS", "2")  # the controller's own step: must not shape the server's
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[1-2]")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    (server,) = slurm_servers(recipe, ["node3"], tmp_path / "policy", EngineArgs(), tmp_path / "logs",
                              environ={"SLURM_JOB_ID": "12"})
    server.token = "tok"
    cmd = server.command()
    assert cmd[:5] == ["srun", "--jobid=12", "--nodes=1", "--ntasks=1", "--nodelist=node3"]
    mem = f"--mem={round(recipe.cluster.controller.mem_gb * 1024)}M"  # the controller's memory per node
    assert "--exact" in cmd and "--cpus-per-task=1" in cmd and mem in cmd and mem == "--mem=2048M"
    serve = cmd[cmd.index("serve"):]
    assert serve[serve.index("--host") + 1] == "0.0.0.0" and "--managed" in serve
    assert "tok" not in " ".join(cmd) and server.remote
    env = server.environment()
    assert env[TOKEN_ENV] == "tok" and env[CONTROL_SECRET_ENV] == server.control_secret
    assert not {"SLURM_NTASKS", "SLURM_STEP_NODELIST", "CUDA_VISIBLE_DEVICES"} & set(env)
    assert server.url_of({"host": "0.0.0.0", "port": 4321}) == "http://node3:4321"
    with pytest.raises(ValueError, match="gets its GPUs from Slurm"):
        SlurmServer(0, "node3", tmp_path, EngineArgs(cuda_devices=(1,)), "", tmp_path, "m", job_id="12")
