"""Recipe sections of the trainer: `trainer` (torch / fsdp2 / megatron, weight sync, router replay, LoRA) and its placement checks.

Part of the recipe schema (`rl_core.config.schema` re-exports every name); no torch import."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rl_core.config.base import Section, fail


# --------------------------------------------------------------------------- trainer


class FSDPConfig(Section):
    """`trainer.backend: fsdp2`: torch FSDP2 (`fully_shard`, DTensor parameters), one process per device."""

    mixed_precision: Literal["auto", "bf16", "none"] = "auto"
    """`bf16`: bf16 parameters and compute, fp32 gradient reduction, fp32 master weights and optimizer (GPU only); `none`: everything in model.dtype; `auto`: bf16 on GPU, none on CPU."""
    reshard_after_forward: bool = True
    """Free each layer's gathered parameters after its forward and gather them again in backward (ZeRO-3 memory); false keeps them until backward (less communication, more memory)."""
    layers_per_unit: int = Field(1, ge=1)
    """Consecutive decoder layers sharded as one FSDP unit (one all-gather, one reduce-scatter and one set of FSDP hooks per unit instead of per layer); a value at or above the layer count makes all layers one unit. Larger units cut FSDP's per-step host work (on one GPU, where nothing is really sharded, set it to the layer count) at the cost of more gathered parameters alive at once; the arithmetic is the same (docs/performance.md)."""
    data_parallel_replicate_size: int = Field(1, ge=1)
    """HSDP: number of model replicas; each shards the model over world_size / this many processes (1 = plain FSDP over all processes)."""
    compile: bool = False
    """torch.compile each decoder layer (dynamic shapes) before sharding, fusing the norm, rotary and SwiGLU element-wise work, and take the fused logprob path (as trainer.compile does for the torch backend); the first steps pay the compilation."""


class MegatronConfig(Section):
    """`trainer.backend: megatron`: Megatron-core GPTModel (local layer spec) with weights converted from and back to the HF layout."""

    tensor_model_parallel_size: int = Field(1, ge=1)
    """Tensor parallel size (splits attention heads, MLP width and vocabulary); must divide the number of key/value heads."""
    pipeline_model_parallel_size: int = Field(1, ge=1)
    """Pipeline parallel size; only 1 is supported (the split step API streams chunks that a pipeline schedule would reorder)."""
    mixed_precision: Literal["auto", "bf16", "none"] = "auto"
    """`bf16`: bf16 parameters and compute with fp32 main weights in Megatron's optimizer, seeded from the checkpoint's own values (GPU only); `none`: model.dtype; `auto`: bf16 on GPU, none on CPU."""
    optimizer: Literal["auto", "megatron", "torch"] = "auto"
    """`megatron`: Megatron's optimizer (fp32 main params, fused Adam; GPU only); `torch`: torch AdamW on Megatron's gradient buffers; `auto`: megatron on GPU, torch on CPU."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and all-reduce gradients in fp32 even when parameters are bf16."""
    compile: bool = False
    """torch.compile each Megatron TransformerLayer (dynamic shapes): fuses the local layer spec's unfused norm, rotary, SwiGLU and residual element-wise work (Transformer Engine is not used); the first steps pay the compilation."""
    fused_elementwise: Literal["auto", "on", "off"] = "auto"
    """Fuse the local layer spec's element-wise work without Transformer Engine: torch.compile each RMSNorm and the rotary embedding (forward and backward into one kernel each), and Megatron's own compiled SwiGLU (`bias_activation_fusion`); the GEMMs, attention and the layer code stay eager. `auto`: on with CUDA, off on CPU; `on`: also on CPU (inductor's C++ backend); `off`: Megatron's eager ops. Not with `compile: true` (which compiles the whole layers). Same math; rounding-level differences in bf16. About a fifth off megatron's step (docs/performance.md, docs/benchmarks.md)."""
    attention: Literal["sdpa", "local"] = "sdpa"
    """Core attention: `sdpa` = torch's fused scaled_dot_product_attention (flash attention on GPU), `local` = Megatron's unfused local-spec attention (materialises the score matrix)."""


class WeightSyncConfig(Section):
    """How new weights reach the generation backends at refit."""

    type: Literal["in_process", "filesystem", "broadcast"] = "in_process"
    """`in_process`: hand the state dict to in-process engines; `filesystem`: write a versioned safetensors directory plus a ready marker that engines load (works across processes and nodes with a shared file system); `broadcast`: send the tensors from trainer rank 0 to the local `rl-core serve` processes of `generation.backend: http` over a process group of their own (NCCL on GPU, gloo on CPU; `rl_core.weights.broadcast`), no files."""
    dir: str | None = None
    """Root of the versioned weight directories (`filesystem`); null = <run dir>/weights."""
    keep_last_versions: int = Field(2, ge=1)
    """Versions kept on disk (`filesystem`); older ones are deleted once a newer one is ready."""
    bucket_size_mb: float = Field(256.0, gt=0)
    """`broadcast`: most MiB packed into one collective (a larger tensor travels alone)."""


class RouterReplayConfig(Section):
    """Rollout Routing Replay (R3, Ma et al. 2025, arXiv 2510.11370) for mixture-of-experts policies: the trainer routes each token to the experts generation chose."""

    enabled: bool = False
    """Replay the routed experts recorded by generation in every trainer forward (training, old and reference logprobs): gate weights are the trainer router's softmax at the replayed experts, renormalised, so the router still gets gradients. Needs an MoE policy, `trainer.backend: torch` and `generation.backend: native`; a sample without routes is an error; tokens with missing routes are routed by the trainer (metric `train/router_replay_backfill_frac`)."""


class LRScheduleConfig(Section):
    """How the policy's learning rate changes over the run's RL steps (`trainer.lr_schedule`)."""

    type: Literal["constant", "linear", "cosine"] = "constant"
    """`constant`: trainer.lr at every RL step; `linear` / `cosine`: after the warm-up, from trainer.lr down towards trainer.lr * min_lr_ratio at grpo.max_num_steps, on a straight line or a half cosine (the schedules of transformers' get_linear_schedule_with_warmup / get_cosine_schedule_with_warmup; cosine: Loshchilov & Hutter 2017). A function of the RL step alone, so a resumed run continues it exactly."""
    warmup_steps: int = Field(0, ge=0)
    """RL steps over which the rate rises linearly to trainer.lr (the k-th RL step of the warm-up uses trainer.lr * k / warmup_steps); 0 = none."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """`linear` / `cosine`: the rate approached at grpo.max_num_steps, as a share of trainer.lr."""


class LoraConfig(Section):
    """`trainer.lora`: train low-rank adapters (LoRA, Hu et al. 2021, arXiv 2106.09685) with PEFT on the frozen policy instead of every weight (docs/lora.md)."""

    enabled: bool = False
    """Train LoRA adapters (needs the `lora` extra: `pip install 'rl_core[lora]'`): the optimizer and its state hold the adapters only, checkpoints hold them in PEFT's format beside the base model's identity and hash, and the final policy is written merged (a plain HF directory) with the adapters in `adapter/`. torch and fsdp2 trainers (megatron refuses it)."""
    rank: int = Field(16, ge=1)
    """r: the adapters' rank (A is r x in_features, B is out_features x r; B starts at zero, so step 0 is the base policy)."""
    alpha: float = Field(32.0, gt=0)
    """The adapters' output is scaled by alpha / rank (PEFT's `lora_alpha`)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input in training forwards (PEFT's `lora_dropout`); logprob passes run without it."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """The linear layers that get adapters: `all-linear` (every linear layer of the decoder, not the LM head) or module names matched as PEFT's `target_modules` does (e.g. [q_proj, v_proj])."""
    refit: Literal["adapters", "merged"] = "adapters"
    """What a refit sends to generation: `adapters` (the A and B matrices only: the native engine and `rl-core serve` merge them into their weights, vLLM serves them as a LoRA adapter) or `merged` (every weight with the adapters merged in: the full-weight path, any backend)."""

    @model_validator(mode="after")
    def _targets(self):
        if isinstance(self.target_modules, list) and not self.target_modules:
            fail("trainer.lora.target_modules", [], "`all-linear` or a non-empty list of module names",
                 "set trainer.lora.target_modules: all-linear, or name the layers (e.g. [q_proj, k_proj, v_proj, o_proj]).")
        return self


class TrainerRecoveryConfig(Section):
    """`trainer.recovery`: in-job recovery of a multi-process trainer group (fsdp2, megatron) whose worker rank died or hung (docs/cluster.md, "Failures")."""

    max_restarts: int = Field(2, ge=0)
    """How many times one run may replace its trainer group after a worker rank is lost (the rollout pump and generation keep running; the new group restores the newest step checkpoint and replays the steps trained since, so nothing is lost or trained twice). 0 = fail fast: the job ends as soon as a worker is lost, naming the rank, and the newest step checkpoint resumes it. Past the budget the job fails the same way. On one host the new ranks are processes of rank 0; across nodes (a Slurm job step) a new step of the same job (`srun --overlap`), and the controller job's step is started with `--kill-on-bad-exit=0 --wait=0` so that rank 0 outlives a killed task."""
    restart_deadline_s: float = Field(600.0, gt=0)
    """How long one replacement may take, from the lost worker to the new group built (its ranks started, the process group formed, the checkpoint's trainer state loaded); the replay of the steps since that checkpoint comes on top. Past it the job fails, naming the rank and the cause."""


class TrainerConfig(Section):
    """The training backend and its optimizer."""

    backend: Literal["torch", "fsdp2", "megatron"] = "torch"
    """`torch`: one process, plain PyTorch (CPU or one GPU); `fsdp2`: torch FSDP2 over N processes (one per device; gloo on CPU, NCCL on GPU); `megatron`: Megatron-core GPTModel (Qwen2/Llama) with tensor and data parallelism."""
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    microbatch_size: int = Field(64, ge=1)
    """Samples per forward/backward pass (per process for fsdp2/megatron); gradients accumulate over a step."""
    max_tokens_per_microbatch: int = Field(0, ge=0)
    """Token budget of a microbatch (0 = off: runs of `microbatch_size` consecutive samples): a chunk's samples are sorted longest first and cut in that order (next-fit) into microbatches of at most this many tokens as the model runs them (the sum of their lengths when packed, samples x the longest when padded) and at most `microbatch_size` samples; a sample longer than the budget goes alone. For the training pass, the logprob passes and the critic; fsdp2/megatron first share the chunk's samples out over the data-parallel ranks by tokens (longest first, each to the rank with the fewest tokens so far). The step does not depend on the split (the loss is summed and normalised once per step), to rounding. Size it to what one padded microbatch held: e.g. microbatch_size x the length cap (docs/performance.md, "Sequence packing")."""
    packing: Literal["auto", "on", "off"] = "auto"
    """Sequence packing: each microbatch's samples run through the model as one row of their real tokens (no padding), every sample restarting at position 0, with variable-length attention within each sample (on CUDA in bf16/fp16 torch's FlashAttention-2 varlen kernels, else one causal SDPA over the samples as rows: rl_core.train.varlen); per-token outputs go back to the padded layout, so the loss, masks, router replay, the critic and the FLOPs counter see the same values as without it, to rounding. Every backend, and the critic. Served: Llama, Qwen2/3, Mistral, Mixtral and Qwen MoE models without a sliding window; megatron with `trainer.megatron.attention: sdpa`. `auto`: packed where served, padded elsewhere; `on`: packed, a recipe error where not served; `off`: padded. Pair with `max_tokens_per_microbatch` so a microbatch holds a token budget rather than a sample count (docs/performance.md, \"Sequence packing\")."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this (null = no clipping)."""
    lr_schedule: LRScheduleConfig = LRScheduleConfig()
    """The learning rate over the run (constant by default; a decay steadies the last RL steps)."""
    logprob_chunk_tokens: int = Field(0, ge=0)
    """`backend: torch`: compute the LM head, log-softmax and the target's logprob this many tokens at a time from the last hidden state, so the [tokens, vocabulary] fp32 logits never exist whole (the backward recomputes each chunk's logits: one extra LM-head matmul); 0 = the full-logits path. Same logprobs to rounding. A memory lever: about a third less peak memory for a slower step at the same microbatch (docs/performance.md). Policies with a plain linear head only (Llama, Qwen2/3, Mistral, Mixtral, Qwen MoE); fsdp2/megatron: must stay 0."""
    compile: bool = False
    """`backend: torch`: torch.compile each decoder layer (dynamic shapes), fusing the norm, rotary and SwiGLU element-wise work, and (with logprob_chunk_tokens 0) take the fused logprob path: compiled log-sum-exp and gradient kernels read the bf16 logits directly, no fp32 copy of them (rl_core.train.logprobs; the largest single gain of the torch backend, docs/performance.md). The first steps pay the compilation. For fsdp2 use trainer.fsdp.compile."""
    collective_timeout_s: float = Field(1800.0, gt=0)
    """fsdp2/megatron: how long a collective (or a worker rank waiting for the driver's next command) may block before the run fails."""
    worker_heartbeat_timeout_s: float = Field(30.0, gt=0)
    """fsdp2/megatron: a worker rank that posts no heartbeat (one a second) for this long counts as gone (killed, hung, or its node lost): rank 0 replaces the trainer group (trainer.recovery) or stops with an error naming its rank, host and pid, instead of waiting collective_timeout_s."""
    recovery: TrainerRecoveryConfig = TrainerRecoveryConfig()
    """fsdp2/megatron: replace a lost worker rank's trainer group inside the running job (docs/cluster.md, "Failures")."""
    fsdp: FSDPConfig = FSDPConfig()
    """Settings of `backend: fsdp2`."""
    megatron: MegatronConfig = MegatronConfig()
    """Settings of `backend: megatron`."""
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    """How refit moves the new weights to generation."""
    router_replay: RouterReplayConfig = RouterReplayConfig()
    """MoE policies: replay generation's expert routes in the trainer (R3)."""
    lora: LoraConfig = LoraConfig()
    """Train LoRA adapters instead of every weight (docs/lora.md)."""

    @model_validator(mode="after")
    def _backend_options(self):
        if self.backend != "torch":
            if self.logprob_chunk_tokens:
                fail("trainer.logprob_chunk_tokens", self.logprob_chunk_tokens,
                      f"0 with trainer.backend '{self.backend}' (only the torch backend computes chunked logprobs)",
                      "set trainer.logprob_chunk_tokens: 0, or trainer.backend: torch.")
            if self.compile:
                fail("trainer.compile", True, f"false with trainer.backend '{self.backend}' (it compiles the torch "
                      "backend's model)", "use trainer.fsdp.compile for fsdp2 or trainer.megatron.compile for megatron, "
                      "or set trainer.backend: torch.")
        if self.lora.enabled and self.backend == "megatron":
            fail("trainer.lora.enabled", True, "false with trainer.backend 'megatron' (the megatron backend trains "
                 "every weight of its converted GPTModel; LoRA adapters are trained by the torch and fsdp2 backends)",
                 "set trainer.backend: fsdp2 (or torch) to train LoRA adapters, or trainer.lora.enabled: false.")
        if self.lora.enabled and self.router_replay.enabled:
            fail("trainer.lora.enabled", True, "false with trainer.router_replay.enabled (router replay hooks the "
                 "routers of the full model; it is not combined with LoRA adapters)",
                 "set trainer.router_replay.enabled: false, or trainer.lora.enabled: false.")
        m = self.megatron
        if self.packing == "on" and self.backend == "megatron" and m.attention != "sdpa":
            fail("trainer.packing", "on", f"'auto' or 'off' with trainer.megatron.attention '{m.attention}' (Megatron's "
                 "local attention takes no packed sequences)", "set trainer.megatron.attention: sdpa, or trainer.packing: "
                 "auto or off.")
        if m.pipeline_model_parallel_size != 1:
            fail("trainer.megatron.pipeline_model_parallel_size", m.pipeline_model_parallel_size,
                  "1 (pipeline parallelism is not supported by the megatron backend)",
                  "set it to 1 and use tensor_model_parallel_size or more data-parallel processes instead.")
        if m.optimizer == "torch" and m.mixed_precision == "bf16":
            fail("trainer.megatron.mixed_precision", "bf16",
                  "'none' or 'auto' with trainer.megatron.optimizer 'torch' (torch AdamW would update bf16 weights "
                  "without fp32 master copies)",
                  "set trainer.megatron.optimizer: megatron (or auto) for bf16 training.")
        if m.compile and m.fused_elementwise == "on":
            fail("trainer.megatron.fused_elementwise", "on", "'auto' or 'off' with trainer.megatron.compile true "
                  "(compiling the whole layers already fuses their element-wise work)",
                  "set trainer.megatron.fused_elementwise: auto, or trainer.megatron.compile: false.")
        return self

    def parallel_product(self) -> tuple[int, str] | None:
        """(product of fixed parallel sizes, their description); the world size must be a multiple of it."""
        if self.backend == "fsdp2":
            return self.fsdp.data_parallel_replicate_size, "trainer.fsdp.data_parallel_replicate_size"
        if self.backend == "megatron":
            return (self.megatron.tensor_model_parallel_size * self.megatron.pipeline_model_parallel_size,
                    "trainer.megatron.tensor_model_parallel_size x pipeline_model_parallel_size")
        return None


def check_trainer_placement(cfg) -> None:
    """Load-time rules tying trainer options to the device and to the node groups (`cluster.trainer`,
    `cluster.generation`); the launch itself is checked against them before any model is built
    (`rl_core.distributed.check_world`)."""
    t, cluster = cfg.trainer, cfg.cluster
    if cfg.runtime.device == "cpu":
        for field, value in (("trainer.fsdp.mixed_precision", t.fsdp.mixed_precision),
                             ("trainer.megatron.mixed_precision", t.megatron.mixed_precision)):
            if value == "bf16" and field.split(".")[1] == {"fsdp2": "fsdp", "megatron": "megatron"}.get(t.backend):
                fail(field, "bf16", "'none' or 'auto' with runtime.device 'cpu' (bf16 mixed precision needs CUDA)",
                      f"set {field}: auto, or runtime.device: cuda.")
        if t.backend == "megatron" and t.megatron.optimizer == "megatron":
            fail("trainer.megatron.optimizer", "megatron", "'torch' or 'auto' with runtime.device 'cpu' "
                  "(Megatron's optimizer allocates on CUDA)", "set trainer.megatron.optimizer: auto.")
    group = cluster.trainer
    if group is not None:
        if group.num_gpus_per_node and group.num_processes_per_node not in (None, group.num_gpus_per_node):
            fail("cluster.trainer.num_processes_per_node", group.num_processes_per_node,
                  f"null or num_gpus_per_node ({group.num_gpus_per_node}): one trainer process per GPU",
                  "remove num_processes_per_node (it defaults to one per GPU).")
        world = group.world_size
        if t.backend == "torch" and world != 1:
            fail("cluster.trainer", group.model_dump(), "one process for trainer.backend 'torch' (it does not "
                  f"distribute); this group has {world}", "set trainer.backend: fsdp2 (or megatron), or shrink the group to 1 process.")
        fixed = t.parallel_product()
        if fixed is not None and world % fixed[0]:
            fail(fixed[1].split(" x ")[0], fixed[0], f"a divisor of the trainer group's {world} processes "
                  f"(cluster.trainer: {group.num_nodes} node(s) x {world // group.num_nodes}); {fixed[1]} = {fixed[0]}",
                  f"change the parallel sizes or the group so that {fixed[0]} divides the number of processes.")
        job = cluster.controller
        if group.num_nodes > job.nodes or world // group.num_nodes > job.tasks_per_node or \
                group.num_gpus_per_node > job.gpus_per_node:
            fail("cluster.trainer", group.model_dump(), "a group that fits in the controller job (cluster.controller: "
                  f"{job.nodes} node(s), {job.tasks_per_node} task(s) and {job.gpus_per_node} GPU(s) per node)",
                  "raise cluster.controller.nodes / tasks_per_node / gpus_per_node to hold the trainer group.")
    if cluster.generation is not None and cfg.generation.placement != "separate":
        fail("cluster.generation", cluster.generation.model_dump(),
              "null with generation.placement 'colocated' (colocated generation runs in the controller's processes)",
              "set generation.placement: separate (vllm or http servers), or remove cluster.generation.")
