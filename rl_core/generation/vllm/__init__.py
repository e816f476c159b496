"""The vLLM backends: vLLM's async engine in this process, or a vLLM OpenAI server over HTTP.

Owns, one module each: `VLLMBackend` and `VLLMOptions` (backend.py, `AsyncLLM` in this
process), `VLLMServerBackend` (server.py, a vLLM OpenAI-compatible server), what the two
share without importing vLLM (common.py), and the worker extension that reloads weights
inside vLLM's worker process (ext.py, imported there by its dotted name).

Does not own: choosing a backend (the registry in `rl_core.generation`). Importing this
package imports none of its modules and no vLLM (vLLM is an optional install); only the
`vllm` builder of the registry imports them. See docs/generation.md, "The vLLM backends".
"""
