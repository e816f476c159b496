"""Training backends behind the TrainerBackend protocol (split step API), and their registry.

`TRAINERS` maps the recipe's `trainer.backend` to a builder, one module per implementation:
- `torch`: `TorchTrainer`, one process (CPU or one GPU; `torch_trainer.py`);
- `fsdp2`: `FSDPTrainer`, torch FSDP2 over N processes (`fsdp.py`);
- `megatron`: `MegatronTrainer`, Megatron-core GPTModel with weights converted from and back
  to the HF layout (`megatron.py`, `megatron_convert.py`).

Multi-process backends run one process per device. Every process calls
`start_trainer_group(cfg)` first: it reads the launch (Slurm step, torchrun or one
process), checks it against the recipe before any model is built, initialises the
process group, and on ranks > 0 serves the driver's commands until the run ends (it then
returns True and the process should exit). Rank 0 goes on to build the run and calls
`make_trainer`. Heavy imports stay inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from rl_core.protocols import TrainerBackend


def trainer_device(cfg) -> str:
    """`cpu` or `cuda` from `runtime.device` (auto = CUDA when available)."""
    import torch

    from rl_core.errors import RecipeError

    if cfg.runtime.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.runtime.device == "cuda" and not torch.cuda.is_available():
        raise RecipeError.single("runtime.device", "cuda", "a machine with a CUDA device",
                                 "set runtime.device: auto (or cpu) on this machine.")
    return cfg.runtime.device


def start_trainer_group(cfg, device: str | None = None) -> bool:
    """Check the launch against the recipe and join the trainer's process group.

    Returns False on the driver (rank 0, or the only process): go on and build the run.
    Returns True on a worker rank once the driver has shut the group down: exit."""
    from rl_core.distributed import check_world, detect_env, init_distributed

    env = detect_env()
    device = device or trainer_device(cfg)
    check_world(cfg, env, device)
    if cfg.trainer.backend == "torch":
        return False
    init_distributed(env, device, cfg.trainer.collective_timeout_s)
    if env.rank == 0:
        return False
    serve_as_worker(cfg)
    return True


def serve_as_worker(cfg) -> None:
    """A worker rank of an initialised process group: follow rank 0's commands until it shuts
    the group down, then leave the group."""
    from rl_core.distributed import destroy_distributed

    if cfg.trainer.backend == "fsdp2":
        from rl_core.train.fsdp import serve_worker
    else:
        from rl_core.train.megatron import serve_worker
    try:
        serve_worker()
    finally:
        destroy_distributed()


def make_trainer(cfg, policy_dir: str | Path, *, device: str | None = None, version: int = 0,
                 trainer_state: dict[str, Any] | None = None, reference_dir: str | Path | None = None,
                 keep_reference: bool | None = None):
    """The recipe's trainer backend over the HF policy directory `policy_dir` (rank 0 / driver).

    The frozen reference of the KL terms (kept when `loss.kl_coef` or
    `advantage.kl_in_reward_coef` > 0) is the run's *initial* policy: `reference_dir`, which a
    resumed run takes from its checkpoint (`trainer_state["reference_dir"]`), else `policy_dir`.
    For fsdp2 and megatron the process group must exist (`start_trainer_group`); with one
    process it is created here. `keep_reference`: the training run's gate
    (`rl_core.controller.train_pump.needs_reference_logprobs`, passed by
    `rl_core.launch.train.build_parts`); None (stand-alone callers) = the recipe's
    `needs_reference_policy`, which that gate returns."""
    device = device or trainer_device(cfg)
    gen = cfg.generation
    if keep_reference is None:
        keep_reference = cfg.needs_reference_policy
    trainer_state = dict(trainer_state) if trainer_state is not None else None
    saved_ref = trainer_state.pop("reference_dir", None) if trainer_state is not None else None
    reference_dir = resolve_reference_dir(reference_dir or saved_ref or policy_dir) if keep_reference else None
    kwargs = dict(logprob_temperature=gen.logprob_temperature,
                  device=device, dtype=cfg.model.dtype, keep_reference=keep_reference, version=version,
                  lr_total_steps=cfg.grpo.max_num_steps)
    if reference_dir is not None and reference_dir != str(Path(policy_dir).resolve()):
        kwargs["reference_dir"] = reference_dir
    backend = cfg.trainer.backend
    build = TRAINERS.get(backend)
    if build is None:
        raise ValueError(f"unknown trainer.backend {backend!r}; expected one of {BACKENDS}")
    trainer = build(cfg, policy_dir, device, kwargs)
    trainer.reference_dir = reference_dir  # saved in run checkpoints (rl_core.checkpoint.run_state)
    if trainer_state is not None:
        trainer.load_state_dict(trainer_state)
    return trainer


def _build_torch(cfg, policy_dir: str | Path, device: str, kwargs: dict[str, Any]) -> TrainerBackend:
    from rl_core.train.torch_trainer import TorchTrainer

    return TorchTrainer(policy_dir, cfg.trainer, **kwargs)


def _join_group(cfg, device: str) -> None:
    """Multi-process backends: with one process (no launcher), create the process group here."""
    import torch.distributed as dist

    if not dist.is_initialized():
        start_trainer_group(cfg, device)


def _build_fsdp2(cfg, policy_dir: str | Path, device: str, kwargs: dict[str, Any]) -> TrainerBackend:
    _join_group(cfg, device)
    from rl_core.train.fsdp import FSDPTrainer

    return FSDPTrainer(policy_dir, cfg.trainer, **kwargs)


def _build_megatron(cfg, policy_dir: str | Path, device: str, kwargs: dict[str, Any]) -> TrainerBackend:
    check_megatron_model(cfg, policy_dir)
    _join_group(cfg, device)
    from rl_core.train.megatron import MegatronTrainer

    return MegatronTrainer(policy_dir, cfg.trainer, **kwargs)


# trainer.backend -> builder(recipe, policy_dir, device, constructor kwargs); heavy imports stay inside
TRAINERS: dict[str, Callable[..., TrainerBackend]] = {
    "torch": _build_torch,
    "fsdp2": _build_fsdp2,
    "megatron": _build_megatron,
}
BACKENDS = tuple(TRAINERS)


def resolve_reference_dir(path: str | Path) -> str:
    """The reference policy's directory as an absolute path; a clear error when it is gone."""
    from rl_core.errors import CheckpointError

    p = Path(path).resolve()
    if not (p / "config.json").is_file():
        raise CheckpointError(
            f"The KL reference policy {p} (the run's initial policy, recorded in its checkpoints) has no "
            "config.json: it was moved or deleted. Fix: restore that directory, or start a new run "
            "(the KL terms must compare against the same initial policy throughout a run).")
    return str(p)


def check_megatron_model(cfg, policy_dir: str | Path) -> None:
    """RecipeError, before anything is built, when the policy cannot be converted to Megatron's
    GPTModel or split over `trainer.megatron.tensor_model_parallel_size`."""
    from transformers import AutoConfig

    from rl_core.errors import RecipeError
    from rl_core.train.megatron_convert import SUPPORTED, check_tensor_parallel, shape_from_hf

    hf_config = AutoConfig.from_pretrained(str(policy_dir))
    try:
        shape = shape_from_hf(hf_config)
    except ValueError as exc:
        raise RecipeError.single("trainer.backend", "megatron",
                                 f"a policy the Megatron conversion supports ({', '.join(SUPPORTED)}; {policy_dir} "
                                 f"has model_type {getattr(hf_config, 'model_type', None)!r}: {exc})",
                                 "use trainer.backend: fsdp2 (any transformers causal LM), or a Qwen2/Llama model.")
    tp = cfg.trainer.megatron.tensor_model_parallel_size
    try:
        check_tensor_parallel(shape, tp)
    except ValueError as exc:
        raise RecipeError.single("trainer.megatron.tensor_model_parallel_size", tp,
                                 f"a size that splits the model in {policy_dir} evenly ({exc})",
                                 "pick a divisor of the number of key/value heads (1 always works).")


def close_trainer(trainer) -> None:
    """Release a multi-process trainer's workers and leave the process group (no-op for `torch`)."""
    close = getattr(trainer, "close", None)
    if close is not None:
        close()
        from rl_core.distributed import destroy_distributed

        destroy_distributed()
