"""Generation: the backends that turn prompts into tokens with logprobs, and their registry.

Owns: `GENERATION_BACKENDS`, the recipe's `generation.backend` -> a builder, one subpackage
per implementation: `native` (`NativeBackend` over rl_core's continuous-batching
`NativeEngine`, in a worker thread of the controller process), `http` (`HttpBackend` over
`rl-core serve` or other OpenAI-compatible servers), `vllm` (`VLLMBackend`, vLLM's async
engine in this process, or `VLLMServerBackend`, a vLLM OpenAI server, by
`generation.placement`); `make_generation_backend(cfg, policy_dir, ...)`, `make_native_engine`
and `vllm_policy_dirs` (what vLLM loads for a LoRA checkpoint). Imports are lazy: vLLM only
when the `vllm` backend is built, torch only when a native or HTTP name is first used.

Does not own: the contract (`rl_core.protocols.GenerationBackend`) or the shared errors and
stream records (`rl_core.generation.base`). Read more: docs/generation.md.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from rl_core.generation.native.engine import NativeEngine
    from rl_core.protocols import GenerationBackend


def make_native_engine(cfg: Any, policy_dir: str | Path, *, tokenizer: Any, device: str,
                       weight_version: int = 0) -> NativeEngine:
    """The recipe's native engine (`EngineOptions.from_recipe`: `generation.native`, slots, dtype,
    seed): the training run's and the validation/evaluation stages' engine alike, so a stage
    never sizes its KV cache for the model's full context. Options the model or device cannot
    honour raise `RecipeError` naming the recipe field."""
    from rl_core.errors import EngineOptionsError
    from rl_core.generation.native.engine import NativeEngine
    from rl_core.generation.native.options import EngineOptions, recipe_error

    options = EngineOptions.from_recipe(cfg, device=device, weight_version=weight_version,
                                        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    try:
        return NativeEngine.from_pretrained(policy_dir, options)
    except EngineOptionsError as exc:  # the options against this model and device
        raise recipe_error(exc) from None


def _build_native(cfg: Any, policy_dir: str | Path, *, tokenizer: Any, device: str,
                  weight_version: int) -> GenerationBackend:
    from rl_core.generation.native.backend import NativeBackend

    engine = make_native_engine(cfg, policy_dir, tokenizer=tokenizer, device=device, weight_version=weight_version)
    # reproducible runs: the engine's batches follow the event loop, not thread timing; a
    # group's results as arrays (packed by memory copies)
    return NativeBackend(engine, lockstep=cfg.async_rl.reproducible, group_arrays=True)


def _build_http(cfg: Any, policy_dir: str | Path, *, tokenizer: Any, device: str,
                weight_version: int) -> GenerationBackend:
    from rl_core.generation.http.backend import make_http_backend

    backend = make_http_backend(cfg, policy_dir, device=device, weight_version=weight_version)
    backend.prepare()  # starts local servers (in the set-up thread, beside the trainer's build)
    return backend


def _build_vllm(cfg: Any, policy_dir: str | Path, *, tokenizer: Any, device: str,
                weight_version: int) -> GenerationBackend:
    from rl_core.generation.vllm.backend import VLLMBackend, VLLMOptions

    gen = cfg.generation
    v = gen.vllm
    lora = cfg.trainer.lora
    serves_adapters = lora.enabled and lora.refit == "adapters"
    model, start = vllm_policy_dirs(policy_dir, serves_adapters)
    options = VLLMOptions(model=model, dtype=cfg.model.dtype, max_model_len=v.max_model_len,
                          max_num_seqs=gen.max_batch_size, kv_cache_memory_bytes=v.kv_cache_memory_bytes,
                          enforce_eager=v.enforce_eager, enable_prefix_caching=v.enable_prefix_caching,
                          seed=cfg.grpo.seed, lora_rank=lora.rank if serves_adapters else 0, lora_start=start)
    if gen.placement == "colocated":
        backend = VLLMBackend(options, weight_version=weight_version)
    else:
        from rl_core.generation.vllm.server import VLLMServerBackend

        backend = VLLMServerBackend(options, weight_version=weight_version, server_url=v.server_url,
                                    startup_timeout_s=v.startup_timeout_s, request_timeout_s=v.request_timeout_s,
                                    weights_dir=v.weights_dir)
    try:
        backend.prepare()
    except BaseException:
        backend.close_sync()
        raise
    return backend


def vllm_policy_dirs(policy_dir: str | Path, serves_adapters: bool) -> tuple[str, str | None]:
    """(the model directory vLLM loads, the adapter it starts with) for a policy directory: an HF
    directory as it is; a LoRA adapter directory (a LoRA run's checkpoint) as its base and that
    adapter (`trainer.lora.refit: adapters`), or as the base with the adapter merged in (`merged`),
    written to a temporary directory removed when the process exits."""
    from rl_core.adapters import is_adapter_dir, merge_adapter_dir, resolve_base

    if not is_adapter_dir(policy_dir):
        return str(policy_dir), None
    if serves_adapters:
        return str(resolve_base(policy_dir)), str(policy_dir)
    import atexit
    import shutil
    import tempfile

    merged = tempfile.mkdtemp(prefix="rl_core_vllm_merged_")
    atexit.register(shutil.rmtree, merged, True)
    merge_adapter_dir(policy_dir, merged)
    return merged, None


# generation.backend -> builder(recipe, policy_dir, *, tokenizer, device, weight_version); imports stay inside
GENERATION_BACKENDS: dict[str, Callable[..., GenerationBackend]] = {
    "native": _build_native,
    "http": _build_http,
    "vllm": _build_vllm,
}


def make_generation_backend(cfg: Any, policy_dir: str | Path, *, tokenizer: Any, device: str,
                            weight_version: int = 0) -> GenerationBackend:
    """The recipe's generation backend (`generation.backend`), fully set up but not started
    (blocking: loads the weights, starts local servers or vLLM's engine / server)."""
    kind = cfg.generation.backend
    build = GENERATION_BACKENDS.get(kind)
    if build is None:
        from rl_core.errors import RecipeError

        raise RecipeError.single("generation.backend", kind, f"one of {', '.join(GENERATION_BACKENDS)}",
                                 "pick a registered generation backend.")
    return build(cfg, policy_dir, tokenizer=tokenizer, device=device, weight_version=weight_version)


# public names, imported on first use (PEP 562) so that `import rl_core.generation` stays light
_LAZY = {
    "GenerationError": "rl_core.generation.base",
    "StreamDelta": "rl_core.generation.base",
    "NativeBackend": "rl_core.generation.native.backend",
    "EngineOptions": "rl_core.generation.native.options",
    "EngineStats": "rl_core.generation.native.engine",
    "NativeEngine": "rl_core.generation.native.engine",
    "StepRecord": "rl_core.generation.native.engine",
    "CausalLM": "rl_core.generation.native.model",
    "ModelSpec": "rl_core.generation.native.model",
    "load_safetensors_dir": "rl_core.generation.native.model",
    "read_config": "rl_core.generation.native.model",
    "GenerationRequestError": "rl_core.generation.http.backend",
    "HttpBackend": "rl_core.generation.http.backend",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_core.generation' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["GENERATION_BACKENDS", "make_generation_backend", "make_native_engine", *sorted(_LAZY)]
