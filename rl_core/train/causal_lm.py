"""What the trainers share about the transformers causal LM they train.

Owns: `DTYPES` (a recipe's dtype name -> the torch dtype a policy or value model is loaded
in) and `decoder_layers` (the repeated blocks of a causal LM: what the torch trainer
compiles one by one with `trainer.compile` and what fsdp2 wraps in `fully_shard` units).

Does not own: loading or building a model (each trainer), logprobs (logprobs.py).
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
