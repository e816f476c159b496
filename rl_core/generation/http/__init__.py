"""The HTTP backend: `HttpBackend` over `rl-core serve` or other OpenAI-compatible servers.

Owns, one module each: the backend (backend.py: generation, retries, weight updates,
aborts, versions), the fleet of servers behind it (fleet.py: routing, health, restarts,
control requests) and the local server processes it starts (servers.py).

Does not own: the servers' engine (`rl_core.generation.native`, served by rl_core.serve)
or choosing a backend (the registry in `rl_core.generation`). Importing this package
imports none of its modules. See docs/generation.md, "The HTTP backend".
"""
