"""Generation: rl_core's native torch engine and the async backend around it.

`NativeEngine` (engine.py) is a synchronous continuous-batching engine for Llama/Qwen2
models over a slot KV cache; `NativeBackend` (backend.py) runs one in a worker thread and
implements the `GenerationBackend` protocol. See each module's docstring for its boundary.
"""

from rl_core.generation.backend import GenerationError, NativeBackend
from rl_core.generation.engine import EngineStats, NativeEngine, StepRecord
from rl_core.generation.model import CausalLM, ModelSpec, load_safetensors_dir, read_config

__all__ = [
    "CausalLM",
    "EngineStats",
    "GenerationError",
    "ModelSpec",
    "NativeBackend",
    "NativeEngine",
    "StepRecord",
    "load_safetensors_dir",
    "read_config",
]
