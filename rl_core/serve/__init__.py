"""Serving rl_core's native engine over HTTP (`rl-core serve`).

An OpenAI-compatible API (completions, chat completions, streaming, logprobs, token ids
in and out) plus the endpoints RL needs (load a weight version from a versioned
safetensors directory, report the served version, abort requests, invalidate the KV
cache, health), so that `HttpBackend` (rl_core.generation.http.backend) can drive several
servers, and any OpenAI client can use one. protocol.py owns request bodies, text.py the
text and logprob layouts, app.py the routes; process start-up (binding, token checks)
is rl_core.launch.serve; what the server and its clients share (the control-secret header,
`MAX_N`) is rl_core.server_contract, below both.
"""
