"""Per-token logprobs of a causal LM for the trainers, with or without the full logits.

Owns: `token_logprobs` (logprob of token t given tokens < t, log_softmax(logits / T) as the
generation engine reports it; position 0 gets 0), its three paths and the rule of which
models the chunked path supports: the reference path (log_softmax over the materialised
[B, T, V] logits in fp32); the chunked path (`chunk_tokens > 0`, `ChunkedHeadLogprobs`: the LM
head, log-sum-exp and target logit `chunk_tokens` tokens at a time, only [chunk, V] logits at
once: a memory lever, off by default); and the fused path (`fused=True`, what
`trainer.compile` / `trainer.fsdp.compile` select, `FusedLogprobs`: compiled kernels over the
model's bf16 logits, no fp32 copy). The classes' docstrings give the gradients and sources.

Does not own: which path a trainer uses (trainer.logprob_chunk_tokens, checked by
`resolve_chunk_tokens`) or any loss. Read more: docs/performance.md, "Knobs".
"""

from __future__ import annotations

import torch

# Causal LMs whose `ForCausalLM.forward` is exactly `lm_head(base_model(...).last_hidden_state)`
# (no logit scaling or soft-capping), so the chunked path computes the same function.
CHUNKED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe"})


def chunked_unsupported_reason(model_or_config) -> str | None:
    """None when the chunked path computes this model's logprobs exactly, else why not."""
    cfg = getattr(model_or_config, "config", model_or_config)
    kind = getattr(cfg, "model_type", None)
    if kind not in CHUNKED_MODEL_TYPES:
        return (f"model type {kind!r} is not one whose logits are a plain linear head over the last hidden "
                f"state (supported: {', '.join(sorted(CHUNKED_MODEL_TYPES))})")
    if isinstance(model_or_config, torch.nn.Module):
        head = model_or_config.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear):
            return f"its output head is a {type(head).__name__}, not a torch.nn.Linear"
        if model_or_config.base_model is model_or_config:
            return "it has no separate base model to run up to the last hidden state"
    return None


def resolve_chunk_tokens(setting: int, model_config) -> int:
    """The chunk size a torch trainer uses (`trainer.logprob_chunk_tokens`; 0 = full logits).
    A chunk size for a model the chunked path does not support is a RecipeError."""
    reason = chunked_unsupported_reason(model_config) if setting > 0 else None
    if reason:
        from rl_core.errors import RecipeError

        raise RecipeError.single("trainer.logprob_chunk_tokens", setting, f"0 for this policy: {reason}",
                                 "set trainer.logprob_chunk_tokens: 0 (the full-logits path).")
    return setting


def _acc_dtype(weight: torch.Tensor) -> torch.dtype:
    """Softmax and accumulation dtype: fp32 for bf16/fp16/fp32 heads (as the reference path's
    `.float()`), float64 for a float64 head (finite-difference checks)."""
    return torch.promote_types(weight.dtype, torch.float32)


class ChunkedHeadLogprobs(torch.autograd.Function):
    """lp[n] = log_softmax(hidden[n] @ W^T (+ b) / T)[targets[n]], `chunk` rows at a time.

    forward(hidden [N, H], weight [V, H], bias [V] or None, targets [N] long, temperature, chunk)
    returns fp32 [N] (float64 for a float64 head). Saves hidden, the weight and the log-sum-exp per row ([N]), never
    the [N, V] logits. The backward recomputes each chunk's logits from the saved hidden states (one
    extra LM-head matmul, as activation checkpointing would pay) and forms the gradient of the logits
    directly, (onehot(y) - softmax(z)) / T; matmuls in the head's dtype, softmax in fp32, as the
    reference path, so the two agree to rounding. The idea of never materialising the full logits is
    that of fused linear cross-entropy kernels (Wijmans et al. 2024, "Cut Your Losses in
    Large-Vocabulary Language Models", arXiv:2411.09009), here in plain PyTorch for logprobs."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int):
        n = hidden.shape[0]
        acc = _acc_dtype(weight)
        out = torch.empty(n, dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = torch.nn.functional.linear(hidden[s:e], weight, bias).to(acc)
            if temperature != 1.0:
                z.div_(temperature)
            lse[s:e] = torch.logsumexp(z, dim=-1)
            out[s:e] = z.gather(-1, targets[s:e, None]).squeeze(-1) - lse[s:e]
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        # partial products accumulate in fp32 (a bf16 sum over chunks would round each one)
        acc = _acc_dtype(weight)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        g_all = grad_out.to(acc) / t
        n = hidden.shape[0]
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            g = g_all[s:e]
            z = torch.nn.functional.linear(hidden[s:e], weight, bias).to(acc)
            if t != 1.0:
                z.div_(t)
            # dz = g * (onehot(y) - softmax(z)) / T, built in place in z's buffer
            dz = z.sub_(lse[s:e, None]).exp_().mul_(-g[:, None])
            dz.scatter_add_(-1, targets[s:e, None], g[:, None])
            dz = dz.to(weight.dtype)
            if need_h:
                grad_h[s:e] = dz @ weight
            if need_w:
                grad_w += (dz.t() @ hidden[s:e]).to(acc)
            if need_b:
                grad_b += dz.to(acc).sum(0)
            del z, dz
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None)


def _lse_and_target(logits: torch.Tensor, targets: torch.Tensor, inv_t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: log-sum-exp of logits / T and the target's logit / T, in fp32 (float64 for float64
    logits; one pass over V)."""
    z = logits.to(_acc_dtype(logits)) * inv_t
    return torch.logsumexp(z, dim=-1), z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _logits_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                 inv_t: float) -> torch.Tensor:
    """d lp / d logits = (onehot(target) - softmax(logits / T)) * grad / T, in the logits' dtype."""
    z = logits.to(_acc_dtype(logits)) * inv_t
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab == targets.unsqueeze(-1)).to(z.dtype)
    return ((onehot - torch.exp(z - lse.unsqueeze(-1))) * (grad * inv_t).unsqueeze(-1)).to(logits.dtype)


_COMPILED: dict[str, object] = {}


def _kernel(name: str, compiled: bool):
    """`_lse_and_target` / `_logits_grad`, torch.compile'd once per process when `compiled`."""
    fn = {"lse": _lse_and_target, "grad": _logits_grad}[name]
    if not compiled:
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=True)
    return _COMPILED[name]


class FusedLogprobs(torch.autograd.Function):
    """lp[..., t] = log_softmax(logits[..., t, :] / T)[targets[..., t]] without an fp32 copy of the logits.

    forward(logits [..., V] (any float dtype), targets [...] long, temperature, compiled) returns
    fp32 [...] (float64 for float64 logits). Saves the logits and the per-token log-sum-exp. The
    forward is one compiled reduction (log-sum-exp and the target's logit, read from the logits as
    they are), the backward one compiled element-wise kernel writing (onehot(y) - softmax(z)) / T in
    the logits' dtype: the fp32 copy, log_softmax's output and the gather's scattered gradient of the
    reference path never exist; the reference's gradient is also cast back, so they agree to rounding."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, compiled: bool):
        inv_t = 1.0 / float(temperature)
        lse, target = _kernel("lse", compiled)(logits, targets, inv_t)
        ctx.save_for_backward(logits, targets, lse)
        ctx.inv_t, ctx.compiled = inv_t, compiled
        return target - lse

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets, lse = ctx.saved_tensors
        grad = _kernel("grad", ctx.compiled)(logits, targets, lse, grad_out.to(lse.dtype), ctx.inv_t)
        return grad, None, None, None


def fused_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float,
                         compiled: bool) -> torch.Tensor:
    """[B, T] logprob of token t given tokens < t from the [B, T, V] logits (position 0 gets 0), by
    `FusedLogprobs` (compiled kernels when `compiled`)."""
    # the last position predicts nothing: its target is a placeholder and its logprob dropped
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    lp = FusedLogprobs.apply(logits, targets, float(temperature), compiled)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp[:, :-1]], dim=1)


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, chunk_tokens: int = 0, fused: bool = False) -> torch.Tensor:
    """[B, T] logprob of token t given tokens < t (position 0 gets 0). `chunk_tokens` > 0 takes the
    chunked path (the caller checked `chunked_unsupported_reason`); else `fused` the compiled
    fused path over the full logits, and neither the full-logits reference."""
    if chunk_tokens <= 0 and fused:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return fused_token_logprobs(logits, input_ids, temperature, compiled=logits.is_cuda)
    if chunk_tokens <= 0:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        logits = logits[:, :-1].float()
        if temperature != 1.0:
            logits = logits / temperature
        lp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    b, t = input_ids.shape
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    h = hidden[:, :-1].reshape(b * (t - 1), hidden.shape[-1])
    lp = ChunkedHeadLogprobs.apply(h, head.weight, head.bias, input_ids[:, 1:].reshape(-1), float(temperature),
                                   int(chunk_tokens))
    return torch.cat([torch.zeros(b, 1, dtype=lp.dtype, device=lp.device), lp.view(b, t - 1)], dim=1)
