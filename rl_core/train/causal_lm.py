"""What the trainers share about the transformers causal LM they train.

Owns: `DTYPES` (a recipe's dtype name -> the torch dtype a policy or value model is loaded
in), `decoder_layers` (the repeated blocks of a causal LM: what the torch trainer
compiles one by one with `trainer.compile` and what fsdp2 wraps in `fully_shard` units), and
the Llama-like model types (`llama_like_reason`) that the chunked logprob path and sequence
packing serve.

Does not own: loading or building a model (each trainer), logprobs (logprobs.py).
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# HF causal LMs whose `ForCausalLM.forward` is exactly `lm_head(base_model(...).last_hidden_state)`
# (no logit scaling or soft-capping) and whose attention goes through transformers' attention
# functions, which receive the model call's keyword arguments (cu_seq_lens_q, max_length_q)
LLAMA_LIKE_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe"})


def llama_like_reason(model_or_config, what: str) -> str | None:
    """None for an HF model (or config) of a `LLAMA_LIKE_TYPES` type, else why not: its type is
    not one `what` (e.g. "whose attention takes packed sequences")."""
    kind = getattr(getattr(model_or_config, "config", model_or_config), "model_type", None)
    if kind in LLAMA_LIKE_TYPES:
        return None
    return f"model type {kind!r} is not one {what} (supported: {', '.join(sorted(LLAMA_LIKE_TYPES))})"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers causal LM, in order."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return list(layers)
    found = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not found:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard "
                         "(expected model.model.layers or modules named *DecoderLayer)")
    return found
