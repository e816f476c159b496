"""The FSDP2 training backend (`trainer.backend: fsdp2`): torch `fully_shard` over N processes.

Owns: building a transformers causal LM sharded with FSDP2 (one `fully_shard` unit per
`trainer.fsdp.layers_per_unit` decoder layers plus the root; HSDP with
`data_parallel_replicate_size > 1`); mixed precision (bf16 parameters and compute, fp32
gradient reduction, fp32 master weights and AdamW state); scaling, clipping and AdamW on each
rank's local shards (`ShardLocalAdamW`: no DTensor dispatch per parameter); loading (rank 0
reads the HF directory, every rank shards a meta-device model and receives only its shard:
no rank but 0 holds the full model); gradients as one process over the whole step (FSDP2
averages over ranks, each rank backpropagates its loss sum, `finish` scales by world_size /
the step's normalizer); packed rows (`trainer.packing`: rl_core.train.varlen's attention);
full-weight export under HF names; DCP checkpoints read without pickle; LoRA adapters
(`trainer.lora`, rl_core.train.lora: injected before sharding; KL reference: the base). Not: the loss, the step loop (train pump), weight transport, or the process layout
(spmd.py, data_parallel.py). Read more: docs/distributed-training.md, docs/performance.md.
"""

from __future__ import annotations

import contextlib
import math
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_core.config.schema import TrainerConfig
from rl_core.packing import PackedRows
from rl_core.train.causal_lm import DTYPES, decoder_layers
from rl_core.train.data_parallel import DataParallelTrainer
from rl_core.train.fused_adam import fused_adamw
from rl_core.train.logprobs import token_logprobs
from rl_core.train.lora import LoraPolicy, attach, base_dir_of, load_policy
from rl_core.train.spmd import CommandChannel
from rl_core.train.varlen import resolve_packing, use_packed_attention
from rl_core.types import TrainChunk


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise), without `to_local`'s autograd wrapper."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class ShardLocalAdamW(torch.optim.AdamW):
    """torch's AdamW whose update runs on the local shards of FSDP2's DTensor parameters.

    The parameters, gradients and state stay DTensors (so the full and sharded optimizer state
    dicts of `torch.distributed.checkpoint` are unchanged); `step` hands the same multi-tensor
    update (`torch.optim.adam.adam`, this group's foreach/fused choice) their local tensors
    instead, so each of its operators runs once over plain tensors rather than through DTensor's
    dispatch for every parameter: element-wise, hence the same numbers, with less host work.
    """

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim.adam import adam

        if closure is not None:
            raise ValueError("ShardLocalAdamW.step takes no closure")
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            beta1, beta2 = group["betas"]
            adam([_local(t) for t in params], [_local(t) for t in grads], [_local(t) for t in exp_avgs],
                 [_local(t) for t in exp_avg_sqs], [_local(t) for t in max_exp_avg_sqs],
                 [_local(t) for t in steps], amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1,
                 beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
                 differentiable=group["differentiable"], fused=group["fused"],
                 decoupled_weight_decay=group["decoupled_weight_decay"])
        return None


def layer_units(layers: list[torch.nn.Module], per_unit: int) -> list[list[torch.nn.Module]]:
    """`trainer.fsdp.layers_per_unit`: consecutive layers grouped into FSDP units (the last may be shorter)."""
    if per_unit < 1:
        raise ValueError(f"trainer.fsdp.layers_per_unit must be >= 1, got {per_unit}")
    return [layers[i:i + per_unit] for i in range(0, len(layers), per_unit)]


def _non_persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    persistent = set(model.state_dict().keys())
    return {name: buf for name, buf in model.named_buffers() if name not in persistent}


class FSDPTrainer(DataParallelTrainer):
    """`trainer.backend: fsdp2`. Construct on every rank of an initialised process group (rank 0
    first publishes the call, so worker ranks in `serve_worker` build it alongside)."""

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig, *, logprob_temperature: float = 1.0,
                 device: str = "cpu", dtype: str = "float32", keep_reference: bool = False, version: int = 0,
                 reference_dir: str | Path | None = None, lr_total_steps: int = 0):
        with self._constructing(model_dir=model_dir, cfg=cfg, logprob_temperature=logprob_temperature, device=device,
                                dtype=dtype, keep_reference=keep_reference, version=version, reference_dir=reference_dir,
                                lr_total_steps=lr_total_steps):
            from transformers import AutoConfig

            world = dist.get_world_size()
            self._setup_step_state(dist.get_rank(), world, None, version)
            self.packed = resolve_packing(cfg.packing, AutoConfig.from_pretrained(str(model_dir)))  # before any weights
            self.dtype = DTYPES[dtype]
            mp = cfg.fsdp.mixed_precision
            if mp == "auto":
                mp = "bf16" if self.device.type == "cuda" else "none"
            if mp == "bf16" and self.device.type != "cuda":
                raise ValueError("trainer.fsdp.mixed_precision 'bf16' needs CUDA devices")
            self.mixed_precision = mp
            self.mesh = self._mesh(world)
            self.lora: LoraPolicy | None = None
            self.model, self.hf_config = self._build(model_dir, trainable=True)
            # LoRA: the reference (the run's initial policy) is the base model, i.e. this one with its adapters off
            self.reference_is_base = keep_reference and self.lora is not None and (
                reference_dir is None or Path(reference_dir).resolve() == self.lora.base_dir)
            self.reference = (self._build(reference_dir or model_dir, trainable=False)[0]  # the initial policy
                              if keep_reference and not self.reference_is_base else None)
            self.optimizer = ShardLocalAdamW(
                [p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                weight_decay=cfg.weight_decay, foreach=True)
            # on CUDA the fused kernel over the local shards (about half the update's time over fp32 master
            # weights; over the DTensors themselves it was slower: docs/performance.md)
            fused_adamw(self.optimizer)

    # ------------------------------------------------------------------ building

    def _mesh(self, world: int):
        from torch.distributed.device_mesh import init_device_mesh

        rep = self.cfg.fsdp.data_parallel_replicate_size
        if world % rep:
            raise ValueError(f"trainer.fsdp.data_parallel_replicate_size ({rep}) must divide the world size ({world})")
        if rep == 1:
            return init_device_mesh(self.device.type, (world,), mesh_dim_names=("shard",))
        return init_device_mesh(self.device.type, (rep, world // rep), mesh_dim_names=("replicate", "shard"))

    def _build(self, model_dir: str | Path, trainable: bool):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoConfig, AutoModelForCausalLM

        lora = self.cfg.lora if trainable else self.cfg.lora.model_copy(update={"enabled": False})
        base_dir = base_dir_of(model_dir, verify=dist.get_rank() == 0) if lora.enabled else Path(model_dir)
        hf_config = AutoConfig.from_pretrained(str(base_dir))
        full_sd: dict[str, torch.Tensor] = {}
        buffers: list[Any] = [None]
        if dist.get_rank() == 0:  # LoRA: the base with its adapters (a checkpoint's, else fresh ones)
            src, _ = load_policy(model_dir, lora,
                                 lambda d: AutoModelForCausalLM.from_pretrained(str(d), dtype=self.dtype))
            full_sd = src.state_dict()
            buffers[0] = {k: v.clone() for k, v in _non_persistent_buffers(src).items()}
            del src
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=self.dtype)
        if self.packed:
            use_packed_attention(model)
        if lora.enabled:  # the same LoRA layers on every rank, before sharding (their values come from rank 0)
            model, self.lora = attach(model, lora, base_dir)
        kwargs: dict[str, Any] = {"mesh": self.mesh, "reshard_after_forward": self.cfg.fsdp.reshard_after_forward}
        if self.mixed_precision == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        layers = decoder_layers(model)
        if self.cfg.fsdp.compile:
            for layer in layers:
                # in place: parameter names stay those of the HF model. Automatic dynamic shapes (not
                # dynamic=True): under FSDP2 the unsharded parameters enter the graph as inputs, and with
                # dynamic=True their sizes (heads, head dim, hidden) became symbols too, so the compiled
                # RoPE kernels divided by runtime sizes per element (many times the torch backend's RoPE
                # time). Now the first shapes compile static and only the
                # sizes that change between calls (batch, sequence) become symbols, at one recompile.
                layer.compile(dynamic=None)
        for unit in layer_units(layers, self.cfg.fsdp.layers_per_unit):
            fully_shard(unit if len(unit) > 1 else unit[0], **kwargs)  # a list: one FSDP group of several layers
        fully_shard(model, **kwargs)
        model.to_empty(device=self.device)
        set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        dist.broadcast_object_list(buffers, src=0)
        named = dict(model.named_buffers())
        with torch.no_grad():
            for name, value in buffers[0].items():
                named[name].copy_(value.to(self.device))
        del full_sd
        if trainable:
            model.train()
        else:
            model.eval()
            for p in model.parameters():
                p.requires_grad_(False)
        return model, hf_config

    # ------------------------------------------------------------------ hooks

    def _model_logprobs(self, mb: TrainChunk, reference: bool, packed: PackedRows | None = None) -> torch.Tensor:
        model = self.model if reference and self.reference_is_base else self.reference if reference else self.model
        if model is None:
            raise RuntimeError("reference logprobs requested but no reference model is kept (loss.kl_coef == 0)")
        with self.lora.passes(reference) if self.lora is not None else contextlib.nullcontext():
            return token_logprobs(model, mb.input_ids, mb.attention_mask, self.temperature, fused=self.cfg.fsdp.compile,
                                  packed=packed)

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's shards of the gradients (plain tensors: the arithmetic below runs on them
        without DTensor's per-operator dispatch, the same element-wise operations)."""
        return [_local(p.grad) for p in self.model.parameters() if p.grad is not None]

    def _scale_grads(self, total_normalizer: float) -> None:
        scale = self.dp_size / total_normalizer  # FSDP2 reduced the mean over ranks; we want sum / normalizer
        torch._foreach_mul_(self._local_grads(), scale)

    def _clip_grads(self, max_norm: float) -> float:
        """The global L2 norm as DTensor computes it for the sharded gradients (each shard's norm, the
        norm of those, then x**2 summed over the shard dimension of the mesh and x**0.5), and clipping
        as torch.nn.utils.clip_grads_with_norm_ does, both on the local shards."""
        grads = self._local_grads()
        if not grads:
            return 0.0
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        shard_group = self.mesh.get_group("shard")
        if dist.get_world_size(shard_group) > 1:
            total = total ** 2.0
            dist.all_reduce(total, group=shard_group)  # the replicas of HSDP hold equal gradients: not summed
            total = total ** (1.0 / 2.0)
        norm = float(total)
        if math.isfinite(norm) and math.isfinite(max_norm):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            by_device: dict[tuple, list[torch.Tensor]] = {}
            for g in grads:
                by_device.setdefault((g.device, g.dtype), []).append(g)
            for (device, _), group in by_device.items():
                torch._foreach_mul_(group, coef.to(device))
        return norm

    def _optimizer_step(self) -> None:
        self.optimizer.step()

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _optimizer_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _load_optimizer_state(self, state: dict[str, Any] | None) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        box = [state is not None]
        dist.broadcast_object_list(box, src=0)
        if not box[0]:
            return
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state if dist.get_rank() == 0 else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        fused_adamw(self.optimizer)  # the saved groups' flags came back with the state

    # ------------------------------------------------------------------ export and checkpoints

    def _full_state(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """Full (unsharded) tensors: on rank 0's CPU, or with `on_device` on the device of every
        rank (the other ranks drop theirs on return; a full copy per GPU while it lasts)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=not on_device))

    @torch.no_grad()
    def _lora_tensors(self, on_device: bool = False) -> list[tuple[str, torch.Tensor]]:
        """The LoRA parameters gathered whole (a collective: every rank calls it), on rank 0's
        device or CPU; an empty list on the other ranks."""
        from torch.distributed.tensor import DTensor

        out = []
        for name, p in self.model.named_parameters():
            if LoraPolicy.is_lora_name(name):
                full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                if dist.get_rank() == 0:
                    out.append((name, full if on_device else full.cpu()))
        return out

    def _spmd_export_weights(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        if self.lora is not None and self.cfg.lora.refit == "adapters":
            return self.lora.refit_adapters(self._lora_tensors(on_device))
        state = self._full_state(on_device)
        if dist.get_rank() != 0:
            return {}
        return self.lora.merged(state) if self.lora is not None else {k: v.detach() for k, v in state.items()}

    def _spmd_save_pretrained(self, out_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        if self.lora is not None:  # the adapters as a PEFT directory beside the base's identity
            named = self._lora_tensors()
            if dist.get_rank() == 0:
                self.lora.save(out_dir, named)
            dist.barrier()
            return
        state = self._full_state()
        if dist.get_rank() == 0:
            with torch.device("meta"):
                shell = AutoModelForCausalLM.from_config(self.hf_config, dtype=self.dtype)
            shell.load_state_dict(state, assign=True, strict=True)
            shell.save_pretrained(out_dir, safe_serialization=True)
        dist.barrier()

    def save_checkpoint(self, out_dir: str | Path) -> None:
        """Sharded DCP checkpoint (model + optimizer, every rank writes its shards) in
        `out_dir/dcp`, plus the full weights as an HF directory in `out_dir/hf`. Written into a
        temporary sibling and renamed into place by rank 0: a reader never sees half of it."""
        self.channel.call(self, "save_checkpoint", str(out_dir))

    def load_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Restore model and optimizer shards from `save_checkpoint`'s DCP directory (any world size)."""
        self.channel.call(self, "load_checkpoint", str(ckpt_dir))

    def _dcp_state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def _spmd_save_checkpoint(self, out_dir: str) -> None:
        import torch.distributed.checkpoint as dcp

        from rl_core.fsutil import atomic_write_json, fsync_dir, normalize_file_modes

        final = Path(out_dir)
        tmp = final.with_name(f".{final.name}.tmp-dcp")
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        from rl_core.train.dcp_io import JsonMetadataWriter

        dcp.save(self._dcp_state(), storage_writer=JsonMetadataWriter(str(tmp / "dcp")))  # + pickle-free metadata
        self._spmd_save_pretrained(str(tmp / "hf"))
        if dist.get_rank() == 0:
            atomic_write_json(tmp / "trainer_state.json", {"version": self.version,
                                                           "optimizer_steps": self.optimizer_steps,
                                                           "world_size": dist.get_world_size()})
            normalize_file_modes(tmp)  # save_pretrained writes its safetensors 0600: as readable as the rest
            fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            fsync_dir(final.parent)
        dist.barrier()

    def _spmd_load_checkpoint(self, ckpt_dir: str) -> None:
        import json

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._dcp_state()
        from rl_core.train.dcp_io import load_sharded

        # never DCP's pickled .metadata, nor an unrestricted torch load of its non-tensor entries
        load_sharded(state, Path(ckpt_dir) / "dcp")
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        meta = json.loads((Path(ckpt_dir) / "trainer_state.json").read_text())
        self.version = int(meta["version"])
        self.optimizer_steps = int(meta["optimizer_steps"])


def serve_worker(channel: CommandChannel | None = None) -> None:
    """Worker ranks (rank > 0): build the trainer when rank 0 does and follow its commands until shutdown."""
    channel = channel or CommandChannel.shared()
    channel.serve(lambda **kwargs: FSDPTrainer(**kwargs))
