"""Generation: rl_core's native torch engine and the async backend around it.

`NativeEngine` (engine.py) is a synchronous continuous-batching engine for Llama/Qwen2
models over a slot KV cache (token budget, optional FP8 with KV-scale sync, CUDA-graph
decode); `NativeBackend` (backend.py) runs one in a worker thread and implements the
`GenerationBackend` protocol; `HttpBackend` (http_backend.py) implements it over
`rl-core serve` servers (rl_core.serve) or other OpenAI-compatible servers. See each
module's docstring for its boundary.
"""

from rl_core.generation.backend import GenerationError, NativeBackend, StreamDelta
from rl_core.generation.engine import EngineStats, NativeEngine, StepRecord
from rl_core.generation.http_backend import GenerationRequestError, HttpBackend
from rl_core.generation.model import CausalLM, ModelSpec, load_safetensors_dir, read_config

__all__ = [
    "CausalLM",
    "EngineStats",
    "GenerationError",
    "GenerationRequestError",
    "HttpBackend",
    "ModelSpec",
    "NativeBackend",
    "NativeEngine",
    "StepRecord",
    "StreamDelta",
    "load_safetensors_dir",
    "read_config",
]
