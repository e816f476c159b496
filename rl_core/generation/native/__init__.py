"""The native backend: rl_core's own continuous-batching engine and the thread that drives it.

Owns, one module each: `NativeEngine` (engine.py; its records in engine_state.py) and the
`EngineOptions` it is built from (options.py), `NativeBackend` (backend.py, the
`GenerationBackend` protocol over an engine in a worker thread), the model forward
(model.py, moe.py), the slot KV cache and its sizing (kv_cache.py, kv_sizing.py), FP8
scale calibration (kv_calibration.py), static-shape and CUDA-graph decode (decode_graph.py)
and token sampling (sampling.py). `rl-core serve` (rl_core.serve) serves the same engine.

Does not own: choosing a backend (the registry in `rl_core.generation`), the HTTP or vLLM
backends (`rl_core.generation.http`, `rl_core.generation.vllm`). Importing this package
imports none of its modules. See docs/generation.md, "The native engine".
"""
