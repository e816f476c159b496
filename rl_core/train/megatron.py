"""The Megatron-core training backend (`trainer.backend: megatron`).

Owns: building a Megatron-core `GPTModel` with the local layer spec from an HF Qwen2/Llama
directory (weights converted and split over tensor-parallel ranks by `megatron_convert`);
Megatron's DDP over the data-parallel ranks (summed gradients, divided by the step's
normalizer at `finish`); the optimizer (Megatron's with fp32 main weights on GPU, its update
as torch's fused AdamW; torch AdamW on CPU); logprobs through the vocabulary-parallel cross
entropy (the fused path of `rl_core.train.logprobs` on CUDA at TP 1), the LM head in our [b, t]
layout; multi-tensor norm, clipping and main -> model copy; `megatron.compile` or
`megatron.fused_elementwise` (`fuse_elementwise`, `fused_rope`); `attention: sdpa` (and packed
THD rows: `trainer.packing`, `packed_rope`); the CPU set-up workarounds; HF-layout export of
the full weights and checkpoints.
Does not own: the loss, the step loop or weight transport; the process layout (spmd.py,
data_parallel.py). Read more: docs/distributed-training.md, docs/performance.md ("Knobs").
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_core.config.schema import TrainerConfig
from rl_core.packing import PackedRows
from rl_core.train.causal_lm import DTYPES
from rl_core.train.data_parallel import DataParallelTrainer
from rl_core.train.fused_adam import fused_adamw
from rl_core.train.logprobs import fused_token_logprobs, padded_logprobs
from rl_core.train.megatron_convert import (GPTShape, check_tensor_parallel, hf_to_megatron, megatron_to_hf,
                                            merge_tensor_parallel, shape_from_hf, split_tensor_parallel)
from rl_core.train.spmd import CommandChannel
from rl_core.train.varlen import varlen_attention
from rl_core.types import TrainChunk

# megatron-core warns on import and build that Apex / Transformer Engine are absent and
# that it falls back to torch implementations: expected here (local spec), so not shown.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core\.")


@contextlib.contextmanager
def cpu_workarounds(device: torch.device):
    """On CPU: `torch.cuda.current_device()` answers the CPU device while Megatron builds."""
    if device.type != "cpu":
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def fuse_elementwise(model) -> None:
    """Run the local spec's RMSNorms through one compiled function (`trainer.megatron.fused_elementwise`).

    Without Transformer Engine the local spec's norm is torch's RMSNorm, whose eager forward
    and backward on CUDA run as separate fp32 element-wise kernels (upcast, square, mean,
    rsqrt, two broadcast multiplies, downcast; with the rotary and SwiGLU pieces a large share
    of the step: docs/performance.md). Compiled, each norm is one kernel forward and one or two
    backward. The norm modules stay (parameter names and state dict keys are Megatron's);
    their `forward` calls the compiled function. (`Module.compile` on the norm itself does
    nothing: torch.compile skips a top-level frame inside torch.nn, so the module would run eager.)
    """
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm):
            module.forward = functools.partial(_compiled_rms_norm, module)


def _rms_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None, eps: float | None):
    return torch.nn.functional.rms_norm(x, shape, weight, eps)


_COMPILED_NORM = None


def _compiled_rms_norm(module: torch.nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    global _COMPILED_NORM
    if _COMPILED_NORM is None:
        # automatic dynamic shapes: the hidden size and the weight stay static (dynamic=True made them
        # symbols: index arithmetic by runtime sizes in every element), batch and sequence become
        # symbols when they change (one recompile)
        _COMPILED_NORM = torch.compile(_rms_norm, dynamic=None)
    return _COMPILED_NORM(x, module.normalized_shape, module.weight, module.eps)


_COMPILED_ROPE = None


@contextlib.contextmanager
def fused_rope(enabled: bool):
    """Megatron's unfused rotary embedding (`rope_utils._apply_rotary_pos_emb_bshd`) compiled while
    the forward runs: its half-rotation, two multiplies, add and concatenations become one kernel
    each way. The same function, compiled (not a rewrite); `apply_rope_fusion` would need
    Transformer Engine's kernel. Restored on exit (the backward runs the compiled graph it recorded)."""
    global _COMPILED_ROPE
    if not enabled:
        yield
        return
    from megatron.core.models.common.embeddings import rope_utils

    saved = rope_utils._apply_rotary_pos_emb_bshd
    if _COMPILED_ROPE is None:
        _COMPILED_ROPE = torch.compile(saved, dynamic=None)  # heads and head dim static, as the norm's hidden size
    rope_utils._apply_rotary_pos_emb_bshd = _COMPILED_ROPE
    try:
        yield
    finally:
        rope_utils._apply_rotary_pos_emb_bshd = saved


@contextlib.contextmanager
def packed_rope(positions: torch.Tensor):
    """Megatron's rotary embedding of a packed (THD) row by each token's position in its sequence:
    one gather of the frequencies, then the same unfused function as the padded layout (compiled
    under `fused_rope`). Megatron's own THD function (`_apply_rotary_pos_emb_thd`) gives the same
    values but splits the row per sequence with host synchronisations, in every layer."""
    from megatron.core.models.common.embeddings import rope_utils

    saved = rope_utils._apply_rotary_pos_emb_thd

    def by_position(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
                    cp_group=None):
        return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[positions],
                                                     rotary_interleaved=rotary_interleaved,
                                                     multi_latent_attention=multi_latent_attention,
                                                     mscale=mscale).squeeze(1)

    rope_utils._apply_rotary_pos_emb_thd = by_position
    try:
        yield
    finally:
        rope_utils._apply_rotary_pos_emb_thd = saved


def sdpa_core_attention():
    """A core-attention module for the local spec that calls torch's fused SDPA (causal)."""
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale
            self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None:  # trainer.packing: [t, heads, d], sequences end to end
                out = varlen_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                       packed_seq_params.max_seqlen_q, self.softmax_scale)
                return out.reshape(out.shape[0], -1)
            # [s, b, heads, d] -> [b, heads, s, d]; causal mask = the GPT mask (right padding needs no more)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1],
                dropout_p=self.dropout_p if self.training else 0.0)
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SDPACoreAttention


def transformer_config(shape: GPTShape, tp: int, params_dtype: torch.dtype, bf16: bool, on_cpu: bool,
                       fused: bool = False):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads, ffn_hidden_size=shape.ffn_hidden_size, kv_channels=shape.head_dim,
        normalization="RMSNorm", layernorm_epsilon=shape.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=shape.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=fused, masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, attention_softmax_in_fp32=True, tensor_model_parallel_size=tp,
        params_dtype=params_dtype, bf16=bf16, pipeline_dtype=params_dtype, use_cpu_initialization=on_cpu,
        perform_initialization=True, calculate_per_token_loss=True)  # True: it also tags TP-split params


class MegatronTrainer(DataParallelTrainer):
    """`trainer.backend: megatron`. Construct on every rank of an initialised process group."""

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig, *, logprob_temperature: float = 1.0,
                 device: str = "cpu", dtype: str = "float32", keep_reference: bool = False, version: int = 0,
                 reference_dir: str | Path | None = None, lr_total_steps: int = 0):
        from transformers import AutoConfig

        with self._constructing(model_dir=model_dir, cfg=cfg, logprob_temperature=logprob_temperature, device=device,
                                dtype=dtype, keep_reference=keep_reference, version=version, reference_dir=reference_dir,
                                lr_total_steps=lr_total_steps):
            mcfg = cfg.megatron
            on_cpu = self.device.type == "cpu"
            opt = mcfg.optimizer if mcfg.optimizer != "auto" else ("torch" if on_cpu else "megatron")
            mp = mcfg.mixed_precision if mcfg.mixed_precision != "auto" else (
                "none" if on_cpu or opt == "torch" else "bf16")
            if on_cpu and (opt == "megatron" or mp == "bf16"):
                raise ValueError("trainer.megatron.optimizer 'megatron' and mixed_precision 'bf16' need CUDA devices")
            self.optimizer_kind, self.bf16 = opt, mp == "bf16"
            self.params_dtype = torch.bfloat16 if self.bf16 else DTYPES[dtype]
            self.hf_config = AutoConfig.from_pretrained(str(model_dir))
            self.shape = shape_from_hf(self.hf_config)
            tp = mcfg.tensor_model_parallel_size
            check_tensor_parallel(self.shape, tp)
            ps = self._parallel_state(tp)
            self.tp, self.tp_rank, self.tp_group = tp, ps.get_tensor_model_parallel_rank(), \
                ps.get_tensor_model_parallel_group()
            self.mp_group = ps.get_model_parallel_group()
            self._setup_step_state(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                                   ps.get_data_parallel_group(), version)
            # packed THD rows through the SDPA core attention (`on` with local attention: a recipe error)
            self.packed = cfg.packing == "on" or (cfg.packing == "auto" and mcfg.attention == "sdpa")
            hf_sd = _read_hf_weights(model_dir)
            shard = split_tensor_parallel(hf_to_megatron(hf_sd, self.shape), tp, self.tp_rank)
            del hf_sd
            fe = mcfg.fused_elementwise
            # compile: true compiles whole layers (their element-wise work with them)
            self.fused = not mcfg.compile and (fe == "on" or (fe == "auto" and not on_cpu))
            self.tconfig = transformer_config(self.shape, tp, self.params_dtype, self.bf16, on_cpu, self.fused)
            with cpu_workarounds(self.device):
                self._init_rng(on_cpu)
                model = self._gpt(shard)
                ref_shard = shard if reference_dir is None else split_tensor_parallel(  # the initial policy
                    hf_to_megatron(_read_hf_weights(reference_dir), self.shape), tp, self.tp_rank)
                self.reference = self._gpt(ref_shard) if keep_reference else None
                self.model = self._ddp(model)
            if self.reference is not None:
                self.reference.eval()
                for p in self.reference.parameters():
                    p.requires_grad_(False)
            self.optimizer = self._make_optimizer()
            if self.bf16 and self.optimizer_kind == "megatron":
                self._seed_main_params(shard)

    # ------------------------------------------------------------------ building

    def _parallel_state(self, tp: int):
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            if ps.get_tensor_model_parallel_world_size() != tp:
                raise RuntimeError(f"Megatron's model-parallel state already exists with tensor parallel size "
                                   f"{ps.get_tensor_model_parallel_world_size()} (asked for {tp}): one layout per process")
        else:
            with cpu_workarounds(self.device):
                ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
        return ps

    def _init_rng(self, on_cpu: bool) -> None:
        from megatron.core import tensor_parallel

        if on_cpu:
            tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        else:
            tensor_parallel.model_parallel_cuda_manual_seed(1234)

    def _gpt(self, shard: dict[str, torch.Tensor]):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        if self.cfg.megatron.attention == "sdpa":
            spec.submodules.self_attention.submodules.core_attention = sdpa_core_attention()
        theta = self.shape.rope_theta
        model = GPTModel(self.tconfig, spec, vocab_size=self.shape.vocab_size,
                         max_sequence_length=self.shape.max_position_embeddings, position_embedding_type="rope",
                         rotary_base=int(theta) if float(theta).is_integer() else theta,
                         share_embeddings_and_output_weights=self.shape.tied, parallel_output=True)
        model = model.to(device=self.device)
        if self.cfg.megatron.compile:
            for layer in model.decoder.layers:
                layer.compile(dynamic=True)  # in place: parameter names and state dict keys stay Megatron's
        elif self.fused:
            fuse_elementwise(model)
        result = model.load_state_dict({k: v.to(self.params_dtype) for k, v in shard.items()}, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise ValueError(f"HF -> Megatron conversion mismatch: missing {missing}, unexpected {result.unexpected_keys}")
        return model

    def _ddp(self, model):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=self.cfg.megatron.grad_reduce_in_fp32,
                                                   overlap_grad_reduce=False, use_distributed_optimizer=False)
        return DistributedDataParallel(config=self.tconfig, ddp_config=ddp_config, module=model)

    def _make_optimizer(self):
        cfg = self.cfg
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.optimizer_kind == "torch":
            return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                     weight_decay=cfg.weight_decay)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ocfg = OptimizerConfig(optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
                               adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, bf16=self.bf16,
                               params_dtype=self.params_dtype, clip_grad=0.0, use_distributed_optimizer=False)
        optimizer = get_megatron_optimizer(ocfg, [self.model])
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            if hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params: bf16 model, fp32 main
                opt._copy_main_params_to_model_params = foreach_main_to_model(opt)
            fused_adamw(opt.optimizer)
        return optimizer

    def _seed_main_params(self, shard: dict[str, torch.Tensor]) -> None:
        """Start the fp32 main weights from the checkpoint's own values, not from the bf16 model weights.

        Megatron's Float16 optimizer copies each bf16 parameter to make its fp32 main weight, so a
        float32 checkpoint would lose its low bits and every main weight would start on the bf16 grid;
        then an update smaller than half a bf16 ulp (lr 1e-4 against weights ~0.2) leaves the bf16
        model weights unchanged, step after step. Seeded from the checkpoint, the rounded model
        weights follow the fp32 trajectory on average, as the fsdp2 backend's fp32 master does.
        """
        for name, param in self.model.module.named_parameters():
            main = getattr(param, "main_param", None)
            if main is None:
                continue
            if name not in shard:
                raise RuntimeError(f"Megatron parameter {name!r} has no checkpoint tensor to seed its fp32 main "
                                   f"weight from (have {sorted(shard)[:8]}...)")
            main.data.copy_(shard[name].to(device=main.device, dtype=main.dtype))

    # ------------------------------------------------------------------ hooks

    def _model_logprobs(self, mb: TrainChunk, reference: bool, packed: PackedRows | None = None) -> torch.Tensor:
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("reference logprobs requested but no reference model is kept (loss.kl_coef == 0)")
        if packed is not None:  # one row of the real tokens in Megatron's THD layout, sequences restarting at 0
            from megatron.core.packed_seq_params import PackedSeqParams

            ids, pos = packed.pack(mb.input_ids)[None], packed.position_ids[None]
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens, cu_seqlens_kv=packed.cu_seqlens,
                                     max_seqlen_q=packed.max_len, max_seqlen_kv=packed.max_len)
            with cpu_workarounds(self.device), fused_rope(self.fused), packed_rope(packed.position_ids):
                logits = _logits_batch_first(model, ids, pos, None, params)  # [1, N, vocab / tp]
            return padded_logprobs(self._logprobs_of(logits, ids)[0], packed)
        ids = mb.input_ids
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device).unsqueeze(0).expand(b, -1)
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=ids.device), 1)[None, None]  # True = masked
        with cpu_workarounds(self.device), fused_rope(self.fused):
            logits = _logits_batch_first(model, ids, pos, causal)  # [b, t, vocab / tp]
        return self._logprobs_of(logits, ids)

    def _logprobs_of(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[b, t] logprobs of `ids` from their [b, t, vocab / tp] logits (position 0 gets 0)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        if logits.is_cuda and self.tp == 1:  # the whole vocabulary here: the fused path (rl_core.train.logprobs)
            return fused_token_logprobs(logits, ids, self.temperature, compiled=True)
        logits = logits[:, :-1].float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        lp = -vocab_parallel_cross_entropy(logits.contiguous(), ids[:, 1:].contiguous())
        return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True) if self.optimizer_kind == "torch" else self.optimizer.zero_grad()

    def _scale_grads(self, total_normalizer: float) -> None:
        self.model.finish_grad_sync()  # sums over data-parallel ranks (calculate_per_token_loss)
        self.model.scale_gradients(1.0 / total_normalizer)

    def _clip_grads(self, max_norm: float) -> float:
        if self.optimizer_kind == "megatron":
            self.optimizer.prepare_grads()  # the model's gradient buffers -> the fp32 main gradients
            opts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
            # the gradients Megatron's own get_grad_norm counts (no shared or tensor-parallel duplicates)
            norm = global_grad_norm([g for opt in opts for g in opt.get_main_grads_for_grad_norm()],
                                    self.mp_group if self.tp > 1 else None)
            if math.isfinite(norm) and math.isfinite(max_norm):
                coef = max_norm / (norm + 1e-6)  # as megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32
                if coef < 1.0:
                    torch._foreach_mul_([p.grad for opt in opts for p in opt.get_parameters() if p.grad is not None],
                                        coef)
            return norm
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        params = self._params()
        norm = global_grad_norm([p.main_grad for p in params if param_is_not_tensor_parallel_duplicate(p)],
                                self.mp_group if self.tp > 1 else None)
        if math.isfinite(norm) and math.isfinite(max_norm):
            coef = max_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
            if coef < 1.0:
                torch._foreach_mul_([p.main_grad for p in params], coef)
        return norm

    def _optimizer_step(self) -> None:
        if self.optimizer_kind == "megatron":
            self.optimizer.step_with_ready_grads()
            return
        for p in self._params():
            p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
        self.optimizer.step()

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _optimizer_state(self) -> dict[str, Any] | None:
        mine = self.optimizer.state_dict()
        if self.tp == 1:
            return mine
        every: list[Any] = [None] * self.tp
        dist.all_gather_object(every, mine, group=self.tp_group)
        return {"tp_shards": every}

    def _load_optimizer_state(self, state: dict[str, Any] | None) -> None:
        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
        if state is None:
            return
        self.optimizer.load_state_dict(state["tp_shards"][self.tp_rank] if self.tp > 1 else state)
        if self.optimizer_kind == "megatron":  # a state saved before the fused update, or on the CPU, loads unfused
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                fused_adamw(opt.optimizer)

    # ------------------------------------------------------------------ export

    def _full_megatron_state(self) -> dict[str, torch.Tensor] | None:
        """Whole Megatron tensors on the ranks of data-parallel rank 0 (None elsewhere)."""
        if self.dp_rank != 0:
            return None
        local = {k: v.detach() for k, v in self.model.module.state_dict().items() if not k.endswith("_extra_state")}
        if self.tp == 1:
            return local
        shards: list[dict[str, torch.Tensor]] = [dict() for _ in range(self.tp)]
        for name, t in local.items():
            parts = [torch.empty_like(t) for _ in range(self.tp)]
            dist.all_gather(parts, t.contiguous(), group=self.tp_group)
            for r in range(self.tp):
                shards[r][name] = parts[r]
        return merge_tensor_parallel(shards)

    def _spmd_export_weights(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        full = self._full_megatron_state()
        if dist.get_rank() != 0:
            return {}
        return {k: v if on_device else v.cpu() for k, v in megatron_to_hf(full, self.shape).items()}

    def _spmd_save_pretrained(self, out_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        state = self._spmd_export_weights()
        if dist.get_rank() == 0:
            with torch.device("meta"):
                shell = AutoModelForCausalLM.from_config(self.hf_config, dtype=self.params_dtype)
            if self.shape.tied:
                state.pop("lm_head.weight", None)
            shell.load_state_dict(state, assign=True, strict=False)
            shell.tie_weights()
            shell.save_pretrained(out_dir, safe_serialization=True)
        dist.barrier()


def global_grad_norm(grads: list[torch.Tensor], group=None) -> float:
    """The L2 norm of `grads` together, and over the ranks of `group` when given (each rank's
    sum of squares all-reduced, as Megatron's get_grad_norm_fp32 does): one norm per tensor by
    torch's multi-tensor kernel and one device-to-host copy. Megatron's own function, without
    Transformer Engine or Apex (its local fallback), copies every tensor's norm to the host
    separately: hundreds of synchronisations a step."""
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if group is None or dist.get_world_size(group) == 1:
        return float(total)
    sq = total.float() ** 2
    dist.all_reduce(sq, group=group)
    return float(sq) ** 0.5


def foreach_main_to_model(opt):
    """Megatron's Float16 optimizer's copy of the updated fp32 main weights (`fp32_from_float16_groups`)
    into the bf16 model weights (`float16_groups`) as one multi-tensor copy. Its own copy, without
    Transformer Engine or Apex, runs `model.copy_(main * 1.0)` tensor by tensor (a multiply, a
    temporary and a copy per parameter); the values are the same (x * 1.0 = x, the same rounding
    to bf16)."""
    def copy() -> None:
        model = [p.data for group in opt.float16_groups for p in group]
        main = [p.data for group in opt.fp32_from_float16_groups for p in group]
        if len(model) != len(main):
            raise RuntimeError(f"Megatron optimizer: {len(model)} model weights but {len(main)} main weights")
        if model:
            torch._foreach_copy_(model, main)

    return copy


@contextlib.contextmanager
def _hidden_states_out(gpt):
    """GPTModel.forward returns the decoder's output (final norm applied) instead of the logits."""
    saved = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = saved


def _logits_batch_first(model, ids: torch.Tensor, pos: torch.Tensor, causal: torch.Tensor | None,
                        packed_seq_params=None) -> torch.Tensor:
    """[b, t, vocab / tp] logits, the LM head applied to the hidden states in our [b, t] layout.

    GPTModel's own path computes the logits in its [s, b] layout and returns
    `logits.transpose(0, 1).contiguous()`: a copy of the whole [tokens, vocabulary] tensor
    (5 GB in bf16 at 16 x 1024 tokens and Qwen2.5's 151,936 words) and another of its gradient
    in backward. Transposing the hidden states instead moves [tokens, hidden] (170x smaller);
    every logit is the same dot product of the same row and weight.
    """
    gpt = getattr(model, "module", model)  # Megatron's DistributedDataParallel wraps the GPTModel
    with _hidden_states_out(gpt):
        hidden = model(ids, pos, causal, packed_seq_params=packed_seq_params)  # [s, b, h]
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    logits, _ = gpt.output_layer(hidden.transpose(0, 1).contiguous(), weight=weight)
    return logits


def _read_hf_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from rl_core.generation.native.model import load_safetensors_dir

    sd = load_safetensors_dir(model_dir)
    if "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied checkpoints may omit it
    return sd


def serve_worker(channel: CommandChannel | None = None) -> None:
    """Worker ranks (rank > 0): build the trainer when rank 0 does and follow its commands until shutdown."""
    channel = channel or CommandChannel.shared()
    channel.serve(lambda **kwargs: MegatronTrainer(**kwargs))
