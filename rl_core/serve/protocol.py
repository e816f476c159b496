"""Request bodies of the server's HTTP API (OpenAI-compatible + rl_core's RL endpoints).

Owns: what a request may contain and how it maps to engine `SamplingParams`, the packed
choice `return_token_arrays` asks for (`packed_choice`), and which field a validation error
is about (`param_of`). Field policy: an undefined field is refused (400 naming it); OpenAI
fields that do not change generation are accepted and unused; options the engine cannot
honour are refused unless neutral; numbers finite and in range (temperature in [0,
`MAX_TEMPERATURE`], top_p in (0, 1], n in [1, 128], seed in [0, 2^63 - 1], max_tokens >= 1).
Extensions: `top_k`, `stop_token_ids`, `return_token_ids`, `request_id` (as vLLM names
them), and rl_core's `seeds` (one per choice) and `return_token_arrays` (ids, logprobs and
versions packed, no text).

Does not own: routing, auth or response shapes (app.py), text handling (text.py). Read more:
docs/generation.md, "Endpoints" and "Serving and security" (the whole policy).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rl_core.server_contract import MAX_N
from rl_core.types import MAX_SEED, GenerationResult, SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 10.0
ROLES = ("system", "developer", "user", "assistant", "tool")


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(Body):
    include_usage: bool = False
    """Send a last chunk with token usage (choices empty)."""
    continuous_usage_stats: bool = False
    """Accepted for vLLM compatibility; usage is sent only at the end."""


class SamplingBody(Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    """Served model name (checked against `/v1/models` when given)."""
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    """Extension: keep the k most likely tokens (0 or -1 = off)."""
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = []
    """Extension: token ids that end a choice (besides the model's end-of-sequence ids)."""
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    """Seed of choice 0; choice i uses (seed + i) mod 2^63 (so choices differ and stay reproducible)."""
    seeds: list[Annotated[int, Field(ge=0, le=MAX_SEED)]] | None = None
    """Extension: one seed per choice (length n; choice i of every prompt uses seeds[i]), instead
    of `seed`. HttpBackend sends a prompt group this way: its samples' seeds are derived apart."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    """Accepted and not used (as the other OpenAI fields that do not change the output below)."""
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    return_token_ids: bool = False
    """Extension: add token ids and weight versions to each choice."""
    request_id: str | None = Field(None, min_length=1, max_length=200)
    """Extension: id for `/rl/abort` (unique among requests in flight)."""

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by the native engine; send 0 or leave it out")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by the native engine; leave it out")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        if self.seeds is not None:
            if self.seed is not None:
                raise ValueError("seeds and seed were both sent; send seeds (one per choice) or seed, not both")
            if len(self.seeds) != self.n:
                raise ValueError(f"seeds holds {len(self.seeds)} seeds for n={self.n} choices; send one per choice")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stops):
            raise ValueError("stop holds an empty string")
        return stops

    def sampling_params(self, max_tokens: int, choice: int, top_logprobs: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0), greedy=self.temperature == 0,
            max_tokens=max_tokens, stop_token_ids=tuple(self.stop_token_ids), stop_strings=self.stop_strings(),
            seed=self.seeds[choice] if self.seeds is not None else
            None if self.seed is None else (self.seed + choice) % (MAX_SEED + 1), top_logprobs=top_logprobs)

    def max_tokens_field(self) -> str:
        return "max_tokens"


class CompletionRequest(SamplingBody):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    """Text, texts, token ids, or lists of token ids (one choice set per prompt)."""
    max_tokens: int | None = Field(16, ge=1)
    """New tokens per choice; null = up to the context length."""
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Report each chosen token's logprob and this many most likely alternatives (0 = chosen only)."""
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    return_token_arrays: bool = False
    """Extension (rl_core): each choice carries its tokens packed, instead of `text` and the
    OpenAI `logprobs` layout: `token_ids_i32` and `token_logprobs_f32` (hex of little-endian
    int32 / float32 arrays), `start_version`, `end_version`, and `token_versions` only when the
    weight version changed during the choice. HttpBackend asks for this: decoding the JSON
    lists of a group's answer costs the controller more than the rest of the request."""

    @model_validator(mode="after")
    def _completion_only(self):
        if self.echo:
            raise ValueError("echo is not supported; leave it out (use return_token_ids to get the prompt ids)")
        if self.suffix:
            raise ValueError("suffix is not supported; leave it out")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of ({self.best_of}) must equal n ({self.n}) or be left out")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list")
        if self.return_token_arrays and self.stream:
            raise ValueError("return_token_arrays is not available with stream: true; leave one out")
        if self.return_token_arrays and self.logprobs:
            raise ValueError(f"return_token_arrays carries each chosen token's logprob only; send logprobs 0, not "
                             f"{self.logprobs} (alternatives come in the OpenAI layout, without return_token_arrays)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... pass through to the template

    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Union[str, list[TextPart], None] = None

    def for_template(self) -> dict:
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            msg["content"] = "".join(part.text for part in self.content)
        return msg


class ChatCompletionRequest(SamplingBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    """Deprecated OpenAI name of max_completion_tokens."""
    max_completion_tokens: int | None = Field(None, ge=1)
    """New tokens per choice; null = up to the context length."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    """Extension: open an assistant turn after the messages (the chat template's flag)."""
    continue_final_message: bool = False
    """Extension: continue the last (assistant) message instead of opening a new turn."""
    parallel_tool_calls: bool | None = None
    """Accepted (no tools are called)."""
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_only(self):
        if self.tools:
            raise ValueError("tools is not supported by the native engine (no tool calling); leave it out")
        if self.tool_choice not in (None, "none"):
            raise ValueError("tool_choice is not supported by the native engine; leave it out or send \"none\"")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise ValueError("response_format other than {\"type\": \"text\"} is not supported by the native "
                             "engine; leave it out")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        return self

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


class UpdateWeightsRequest(Body):
    """POST /rl/update_weights: load weight `version` from a safetensors directory."""

    version: int = Field(ge=0)
    """The weight version the directory holds; tokens generated from now on record it."""
    path: str
    """Directory on the server's file system: a version directory of `rl_core.weights.filesystem`
    (`<root>/v000000003` with its READY marker), or an HF directory with require_marker false."""
    require_marker: bool = True
    """Check the READY marker (complete files, this version's directory); false loads any *.safetensors directory."""
    invalidate_kv_cache: bool = False
    """Also drop cached keys/values of requests in flight (they recompute under the new weights)."""


class WeightGroupRequest(Body):
    """POST /rl/init_weight_broadcast: join the trainer's weight-broadcast group (`rl_core.weights.broadcast`)."""

    host: str
    """Address of the group's TCP store, hosted by trainer rank 0."""
    port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1)
    """This server's rank in the group (rank 0 is the trainer)."""
    world_size: int = Field(ge=2)
    timeout_s: float = Field(600.0, gt=0)
    """How long joining, and every later receive, may block."""
    bucket_size_mb: float = Field(256.0, gt=0)
    """Must equal the sender's: buckets are cut the same way on both sides."""


class ReceiveWeightsRequest(Body):
    """POST /rl/receive_weights: receive weight `version` from the broadcast group and load it."""

    version: int = Field(ge=0)
    invalidate_kv_cache: bool = False


class AbortRequest(Body):
    """POST /rl/abort: abort requests by their `request_id` (every choice), or all."""

    request_ids: list[str] = []
    all: bool = False


def packed_choice(result: GenerationResult) -> dict:
    """A choice's tokens as `return_token_arrays` carries them (see CompletionRequest)."""
    # hex, not base64: CPython decodes hex faster per byte (bytes.fromhex against binascii)
    out = {"token_ids_i32": np.asarray(result.token_ids, dtype="<i4").tobytes().hex(),
           "token_logprobs_f32": np.asarray(result.logprobs, dtype="<f4").tobytes().hex(),
           "start_version": result.start_version, "end_version": result.end_version}
    if result.start_version != result.end_version:
        out["token_versions"] = list(result.token_versions)
    return out


def param_of(errors: list[dict]) -> str | None:
    """The field a validation error is about: the common path of the errors (a union's member
    names dropped: `prompt`, not `prompt.str`), or, for a check across fields ("logit_bias is
    not supported ..."), the field its message starts with."""
    locs = [[str(x) for x in e.get("loc", ()) if x != "body"] for e in errors]
    if locs and locs[0]:
        common = locs[0]
        for loc in locs[1:]:
            n = 0
            while n < min(len(common), len(loc)) and common[n] == loc[n]:
                n += 1
            common = common[:n]
        return ".".join(common or locs[0])
    for e in errors:
        m = re.match(r"(?:Value error, )?([a-z_]+)\b", str(e.get("msg", "")))
        if e.get("type") == "value_error" and m:
            return m.group(1)
    return None
