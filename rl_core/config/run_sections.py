"""Recipe sections of a run's surroundings: `checkpoint`, `validation`, `logging`, `runtime`, `evaluation` and `cluster`.

Part of the recipe schema (`rl_core.config.schema` re-exports every name); no torch import."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rl_core.config.base import Section, fail
from rl_core.config.generation_sections import SamplingParamsConfig


# --------------------------------------------------------------------------- validation / logging / runtime


class CheckpointConfig(Section):
    """Step checkpoints inside an epoch, so a killed or preempted run resumes without redoing finished steps."""

    save_every_steps: int = Field(100, ge=0)
    """Write a step checkpoint every this many RL steps (0 = only at the end of each epoch / run)."""
    keep_last: int = Field(2, ge=1)
    """Step checkpoints kept (older ones are deleted once a newer one is complete)."""
    save_every_optimizer_steps: int = Field(0, ge=0)
    """With several optimizer steps per RL step (grpo.ppo_epochs x num_minibatches): also checkpoint between mini-steps every this many optimizer steps, so a long RL step resumes where it stopped (0 = off)."""


class ValidationConfig(Section):
    """Held-out evaluation of the policy, pinned to one weight version each time."""

    val_at_start: bool = True
    """Validate the initial policy before the first RL step."""
    val_at_end: bool = True
    """Validate after the last RL step."""
    val_period: int = Field(0, ge=0)
    """Validate every this many RL steps (0 = only at start/end)."""
    max_val_samples: int | None = Field(None, ge=1)
    """Use at most this many held-out prompts (null = all)."""
    num_val_generations_per_prompt: int = Field(1, ge=1)
    """Samples per prompt (n): `pass@n` (a prompt passes when any of its n samples is correct) and the unbiased `pass_at_k` for every k <= n (Chen et al. 2021) are reported."""
    sampling: SamplingParamsConfig = SamplingParamsConfig(greedy=True)
    """Validation-only sampling parameters (greedy by default)."""
    val_start_at: int = Field(0, ge=0)
    """Periodic validation (val_period) only from this RL step on."""
    pause_rollouts: bool = False
    """Close rollout dispatch while a validation runs (groups already in flight finish). Default: rollouts keep generating for later steps alongside validation (the weight version is pinned either way)."""


TRACKERS = ("tensorboard", "wandb", "mlflow")


class WandbConfig(Section):
    """Weights & Biases, when `logging.trackers` lists `wandb` (the `wandb` extra: `pip install "rl_core[wandb]"`)."""

    mode: Literal["offline", "online"] = "offline"
    """`offline`: the run is written under <run folder>/wandb/ only (no network, no login; upload it later with `wandb sync <run folder>/wandb/offline-run-*`); `online`: streamed to the W&B server (needs `wandb login` or WANDB_API_KEY)."""
    project: str = "rl_core"
    """W&B project the runs belong to."""
    entity: str | None = None
    """W&B team or user (null = your default entity)."""
    tags: list[str] = []
    """Tags of every W&B run of this recipe."""


class MlflowConfig(Section):
    """MLflow, when `logging.trackers` lists `mlflow` (the `mlflow` extra: `pip install "rl_core[mlflow]"`, mlflow-skinny)."""

    tracking_uri: str | None = None
    """null = a local file store in <run folder>/mlruns (no server, no network; browse it with `mlflow ui --backend-store-uri <run folder>/mlruns`); else any MLflow tracking URI (`http://host:5000`, `databricks`, ...)."""
    experiment: str | None = None
    """MLflow experiment of the runs (null = the recipe's run_name)."""


class LoggingConfig(Section):
    """Where metrics go: metrics.jsonl, and the experiment trackers in `trackers` (every tracker gets the same scalars)."""

    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = ["tensorboard"]
    """Experiment trackers the metrics go to, each through its own library: `tensorboard` (event files under <run dir>/tensorboard), `wandb` (see logging.wandb; offline by default), `mlflow` (see logging.mlflow; a file store in the run folder by default). [] = metrics.jsonl only."""
    tensorboard: bool | None = None
    """Older spelling kept for existing recipes: alone, true means `trackers: [tensorboard]` and false `trackers: []`; beside `trackers` it must agree with it; null = as `trackers` says (the resolved config always says null and lists the trackers)."""
    jsonl: bool = True
    """Write one JSON object per RL step to <run dir>/metrics.jsonl."""
    progress: Literal["auto", "line", "off"] = "auto"
    """Terminal progress: `line` redraws one status line, `auto` = line on a terminal and a log line every ~5% otherwise."""
    wandb: WandbConfig = WandbConfig()
    """W&B settings (used when `trackers` lists `wandb`)."""
    mlflow: MlflowConfig = MlflowConfig()
    """MLflow settings (used when `trackers` lists `mlflow`)."""

    @model_validator(mode="after")
    def _trackers(self):
        seen = [t for i, t in enumerate(self.trackers) if t in self.trackers[:i]]
        if seen:
            fail("logging.trackers", self.trackers, "each tracker at most once", f"remove the repeated {seen[0]!r}.")
        if self.tensorboard is None:
            return self
        if "trackers" in self.model_fields_set and ("tensorboard" in self.trackers) != self.tensorboard:
            fail("logging.tensorboard", self.tensorboard, f"agreement with logging.trackers {self.trackers} (it is the "
                 "older spelling of listing `tensorboard` there)", "leave logging.tensorboard out and list the "
                 "trackers in logging.trackers (e.g. logging.trackers=[tensorboard,wandb]; [] = none).")
        if "trackers" not in self.model_fields_set:  # the older boolean alone: it picks the list
            self.trackers = ["tensorboard"] if self.tensorboard else []
        self.tensorboard = None
        return self


class RuntimeConfig(Section):
    """Process-level settings."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: CUDA when available, else CPU."""
    torch_num_threads: int | None = Field(None, ge=1)
    """Intra-op threads for torch on CPU (null = torch's default)."""


# --------------------------------------------------------------------------- workflow: evaluation / cluster


_SET_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class EvaluationConfig(Section):
    """The workflow's `evaluate` stage: chosen checkpoints x named prompt sets, as a submitit job array."""

    sets: dict[str, str] = {}
    """Eval sets: name -> JSON-lines prompt file (same format as data.val_file); empty = `{val: <data.val_file>}`."""
    checkpoints: list[Literal["final", "best"]] = ["final", "best"]
    """Which epoch checkpoints to evaluate: `final` (the last epoch) and/or `best` (highest validation accuracy; ties go to the later epoch)."""
    num_generations_per_prompt: int = Field(4, ge=1)
    """Samples per prompt (n): `pass@n` (any of the n samples correct) and the unbiased `pass_at_k` for every k <= n are reported."""
    max_samples: int | None = Field(None, ge=1)
    """Use at most this many prompts of each set (null = all)."""
    sampling: SamplingParamsConfig = SamplingParamsConfig(temperature=1.0)
    """Evaluation-only sampling parameters (temperature 1 by default, so that pass@k means something)."""

    @model_validator(mode="after")
    def _names(self):
        import re

        for name in self.sets:
            if not re.match(_SET_NAME, name):
                fail(f"evaluation.sets.{name}", name, f"a set name matching {_SET_NAME} (it becomes a file name)",
                      "rename the set with letters, digits, '.', '_' or '-'.")
        if not self.checkpoints:
            fail("evaluation.checkpoints", self.checkpoints, "at least one of 'final', 'best'",
                  "list the checkpoints to evaluate, e.g. [final, best].")
        return self


class SlurmJobConfig(Section):
    """Slurm resources of one submitit job (used when the workflow runs with `--profile profiles/slurm`)."""

    partition: str | None = None
    """Slurm partition (`sbatch --partition`); null = the cluster's default partition."""
    account: str | None = None
    """Slurm account to charge (`--account`); null = your default account."""
    qos: str | None = None
    """Quality of service (`--qos`); null = the default."""
    constraint: str | None = None
    """Node features required (`--constraint`, e.g. `h100`); null = any node."""
    nodes: int = Field(1, ge=1)
    """Nodes of the job."""
    tasks_per_node: int = Field(1, ge=1)
    """Processes per node (the controller job runs one; multi-process trainers set more)."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node (`--gpus-per-node`); 0 = a CPU-only job."""
    cpus_per_task: int = Field(2, ge=1)
    """CPU cores per process (`--cpus-per-task`)."""
    mem_gb: float = Field(8.0, gt=0)
    """Memory per node in GB (`--mem`)."""
    timeout_min: int = Field(60, ge=1)
    """Wall-clock limit of one attempt, in minutes (`--time`; also enforced by the local executor). A job that reaches it checkpoints and is requeued (see cluster.max_num_timeout)."""
    signal_delay_s: int = Field(90, ge=0)
    """Seconds before the time limit at which the job gets SIGUSR2, runs submitit's `checkpoint()` and requeues itself."""
    extra_sbatch: dict[str, str] = {}
    """Further sbatch options, name without dashes -> value (e.g. `{reservation: big}`), passed as submitit's `additional_parameters`."""


class NodeGroupConfig(Section):
    """Placement of one group of processes of a run (the trainer, or the generation servers): nodes and devices."""

    num_nodes: int = Field(1, ge=1)
    """Nodes of the group."""
    num_gpus_per_node: int = Field(0, ge=0)
    """GPUs per node used by the group; 0 = CPU processes."""
    num_processes_per_node: int | None = Field(None, ge=1)
    """Processes (Slurm tasks) per node; null = one per GPU (1 per node on CPU). With GPUs it must equal num_gpus_per_node (one process per device)."""

    @property
    def world_size(self) -> int:
        per_node = self.num_processes_per_node or max(1, self.num_gpus_per_node)
        return self.num_nodes * per_node


class ClusterConfig(Section):
    """Resources of the workflow's submitit jobs: the controller job (train_epoch) and the evaluation job array. Whether they run as local processes or Slurm jobs is the workflow's `launcher` (config/config.yaml; `auto` = Slurm exactly under `--profile profiles/slurm`); the resources are here."""

    controller: SlurmJobConfig = SlurmJobConfig()
    """Resources of the controller job that trains one epoch (the single controller, generation and trainer in one allocation)."""
    evaluation: SlurmJobConfig = SlurmJobConfig(cpus_per_task=1, mem_gb=4.0, timeout_min=30)
    """Resources of each task of the evaluation job array (one checkpoint x one eval set)."""
    max_num_timeout: int = Field(3, ge=0)
    """How many times a job that timed out may be requeued (preemptions do not count) before the stage fails."""
    max_parallel_array_tasks: int = Field(4, ge=1)
    """Evaluation tasks running at once (`--array=...%N` on Slurm; waves of N local processes otherwise)."""
    poll_interval_s: float = Field(2.0, gt=0)
    """How often the waiting workflow rule polls its job and copies the job's log into the rule's log."""
    trainer: NodeGroupConfig | None = None
    """The trainer's node group (fsdp2/megatron: one process per device). Its size must be a multiple of the backend's fixed parallel sizes and fit in the controller job; null = the processes the launcher started (the controller job's tasks, torchrun or srun)."""
    generation: NodeGroupConfig | None = None
    """The generation node group of `generation.placement: separate` (servers on their own nodes and GPUs); null = none (generation colocated with the controller)."""

    @model_validator(mode="after")
    def _delay(self):
        for name in ("controller", "evaluation"):
            job = getattr(self, name)
            if job.signal_delay_s >= job.timeout_min * 60:
                fail(f"cluster.{name}.signal_delay_s", job.signal_delay_s,
                      f"fewer seconds than the time limit (cluster.{name}.timeout_min {job.timeout_min} = "
                      f"{job.timeout_min * 60} s)", "lower signal_delay_s (90 is typical) or raise timeout_min.")
        return self
