"""What every generation backend shares: the error of a failed generation and the streaming delta.

Owns: `GenerationError` (generation failed inside a backend: its worker, a step, or every
server it could try; the cause is chained) and `StreamDelta` (the tokens a streaming request
gained since its previous delta). The contract itself is `rl_core.protocols.GenerationBackend`;
requests, sampling parameters and results are `rl_core.types` records.

Does not own: any backend (`rl_core.generation.native`, `rl_core.generation.http`,
`rl_core.generation.vllm`) or choosing one (the registry in `rl_core.generation`).
"""

from __future__ import annotations

from dataclasses import dataclass


class GenerationError(RuntimeError):
    """Generation failed inside the backend's worker (the cause is chained)."""


@dataclass
class StreamDelta:
    """Tokens a streaming request gained since the previous delta."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
