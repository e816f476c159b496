"""EngineOptions: every setting of a `NativeEngine`, in one record validated when it is built.

Owns: the fields (device and dtype, slots and sequence length, the step and KV-token
budgets, FP8 KV, the decode path, seeds, stop ids, the initial weight version), their
checks that need no model (`EngineOptionsError` naming the field: what was received, what
was expected, the fix), and the two ways a run builds them: `from_recipe` (the recipe's
`generation` section; errors name the recipe field) and `from_serve_args` (the flags of
`rl-core serve`; errors name the flag).

Does not own: the checks that need the model or device (`max_seq_len` within the model's
context, static/graph decode on a mixture of experts, CUDA graphs on a CUDA device, what
`decode_path: auto` resolves to), which `NativeEngine` makes against these options, nor the
defaults that depend on other fields (`max_step_tokens`, `max_num_kv_tokens`), which the
engine resolves. Imports no torch. See docs/generation.md, "The native engine".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from rl_core.errors import ArgumentError, EngineOptionsError, RecipeError

DECODE_PATHS = ("auto", "eager", "static", "graph")
DECODE_ATTENTIONS = ("torch", "fused")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
DTYPES = ("float32", "bfloat16", "float16", "float64")

# EngineOptions field -> its recipe field (from_recipe) and its `rl-core serve` flag (from_serve_args)
# the options named alike in the recipe's `generation.native` section and in `rl-core serve`'s flags
NATIVE_FIELDS = ("max_seq_len", "max_num_kv_tokens", "kv_cache_dtype", "kv_scale_margin", "decode_path",
                 "decode_compile", "overlap_steps", "decode_attention", "decode_mlp")
RECIPE_FIELDS = {"dtype": "model.dtype", "max_batch_size": "generation.max_batch_size", "seed": "grpo.seed",
                 **{f: f"generation.native.{f}" for f in NATIVE_FIELDS}}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineOptions:
    """The settings of one `NativeEngine` (see the engine's docstring for what each does).

    `device`: "cpu", "cuda", "cuda:N" (or a torch.device); `dtype`: a float dtype name or a
    torch dtype. `max_seq_len` (prompt + completion) None = the model's context, at most
    4096. `eos_token_ids` None = the config's. `decode` (token ids -> text) is needed only
    by requests with stop strings. `max_step_tokens` None = max(8192, max_batch_size);
    `max_num_kv_tokens` None = max_batch_size * max_seq_len (only the slots limit admission).
    """

    device: Any = "cpu"
    dtype: Any = "float32"
    max_batch_size: int = 256
    max_seq_len: int | None = None
    eos_token_ids: tuple[int, ...] | None = None
    decode: Callable[[list[int]], str] | None = None
    seed: int = 0
    max_step_tokens: int | None = None
    weight_version: int = 0
    max_num_kv_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    kv_scale_margin: float = 2.0
    decode_path: str = "auto"
    decode_compile: bool = False
    overlap_steps: bool = False
    decode_attention: str = "torch"
    decode_mlp: str = "torch"

    def __post_init__(self) -> None:
        if self.eos_token_ids is not None and not isinstance(self.eos_token_ids, tuple):
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        self._check()

    def _check(self) -> None:
        def bad(field: str, expected: str, fix: str) -> EngineOptionsError:
            return EngineOptionsError(field, getattr(self, field), expected, fix)

        if not (isinstance(self.dtype, str) and self.dtype in DTYPES) and type(self.dtype).__name__ != "dtype":
            raise bad("dtype", f"a float dtype name ({', '.join(DTYPES)}) or a torch dtype", "pick one of those.")
        if not _is_int(self.max_batch_size) or self.max_batch_size < 1:
            raise bad("max_batch_size", "an integer >= 1 (KV-cache slots)", "pass a positive number of slots.")
        if self.max_seq_len is not None and (not _is_int(self.max_seq_len) or self.max_seq_len < 2):
            raise bad("max_seq_len", "an integer >= 2 (prompt + completion tokens) or None (the model's context)",
                      "raise max_seq_len, or leave it unset.")
        if self.eos_token_ids is not None and not all(_is_int(i) and i >= 0 for i in self.eos_token_ids):
            raise bad("eos_token_ids", "token ids (integers >= 0) or None (the model config's)",
                      "pass the tokenizer's end-of-sequence ids.")
        if not _is_int(self.seed) or not 0 <= self.seed <= 2**64 - 1:
            raise bad("seed", "an integer in [0, 2^64 - 1] (torch's generator seed)", "pass a smaller seed.")
        if self.max_step_tokens is not None and (not _is_int(self.max_step_tokens)
                                                 or self.max_step_tokens < self.max_batch_size):
            raise EngineOptionsError(
                "max_step_tokens", self.max_step_tokens,
                f"an integer >= max_batch_size ({self.max_batch_size}), so that every running sequence can "
                "decode in each step", "raise max_step_tokens, or leave it unset (max(8192, max_batch_size)).")
        if not _is_int(self.weight_version) or self.weight_version < 0:
            raise bad("weight_version", "an integer >= 0 (the version of the weights loaded first)",
                      "pass 0 for an initial policy.")
        if self.max_num_kv_tokens is not None and (not _is_int(self.max_num_kv_tokens) or self.max_num_kv_tokens < 2):
            raise bad("max_num_kv_tokens", "an integer >= 2, or None (no limit beyond the slots)",
                      "raise max_num_kv_tokens, or leave it unset.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"one of {', '.join(KV_CACHE_DTYPES)}",
                      "use 'auto' (the model dtype) or 'fp8_e4m3'.")
        if isinstance(self.kv_scale_margin, bool) or not isinstance(self.kv_scale_margin, (int, float)) \
                or not self.kv_scale_margin > 0:
            raise bad("kv_scale_margin", "a number > 0 (headroom of FP8 scales over the calibration maximum)",
                      "leave it at its default 2.0.")
        if self.decode_path not in DECODE_PATHS:
            raise bad("decode_path", f"one of {', '.join(DECODE_PATHS)}", "pick one of those ('auto' picks for you).")
        for flag in ("decode_compile", "overlap_steps"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, "true or false", f"pass a boolean {flag}.")
            if getattr(self, flag) and self.decode_path == "eager":
                raise bad(flag, "false with decode_path 'eager' (it needs the static-shape decode step)",
                          f"use decode_path 'static' or 'graph' (dense models), or turn {flag} off.")
        if self.decode_attention not in DECODE_ATTENTIONS:
            raise bad("decode_attention", f"one of {', '.join(DECODE_ATTENTIONS)}",
                      "use 'torch' (the default) or 'fused' (one Triton kernel, CUDA).")
        if self.decode_attention == "fused" and self.decode_path == "eager":
            raise bad("decode_attention", "'torch' with decode_path 'eager' (the fused kernel serves the "
                      "static-shape decode step)", "use decode_path 'auto' or 'graph' on CUDA, or 'torch'.")

        if self.decode_mlp not in DECODE_ATTENTIONS:
            raise bad("decode_mlp", f"one of {', '.join(DECODE_ATTENTIONS)}",
                      "use 'torch' (the default) or 'fused' (the gate/up projection and SiLU gate in one Triton "
                      "kernel, CUDA).")
        if self.decode_mlp == "fused" and self.decode_attention != "fused":
            raise bad("decode_mlp", "'torch' unless decode_attention is 'fused' (the fused MLP kernel runs in the "
                      "fused decode layer)", "set decode_attention 'fused' too, or decode_mlp 'torch'.")

    def replace(self, **changes: Any) -> EngineOptions:
        """A copy with `changes`, validated again."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_recipe(cls, cfg: Any, *, device: Any, weight_version: int = 0,
                    decode: Callable[[list[int]], str] | None = None) -> EngineOptions:
        """The native engine of a run: `generation.max_batch_size`, `generation.native.*`,
        `model.dtype` and `grpo.seed`. An invalid value raises `RecipeError` naming the recipe field."""
        gen, n = cfg.generation, cfg.generation.native
        try:
            return cls(device=device, dtype=cfg.model.dtype, max_batch_size=gen.max_batch_size, decode=decode,
                       seed=cfg.grpo.seed, weight_version=weight_version, **_native_fields(n))
        except EngineOptionsError as exc:
            raise recipe_error(exc) from None

    @classmethod
    def from_serve_args(cls, args: Any, *, device: Any, dtype: Any, eos_token_ids: Iterable[int] | None = None,
                        decode: Callable[[list[int]], str] | None = None) -> EngineOptions:
        """The engine of `rl-core serve` from its parsed flags (`--max-batch-size`, `--max-seq-len`,
        `--max-num-kv-tokens`, `--kv-cache-dtype`, `--kv-scale-margin`, `--decode-path`,
        `--decode-compile`, `--overlap-steps`, `--decode-attention`, `--decode-mlp`, `--seed`, `--weight-version`); the device and dtype
        as resolved from `--device`/`--dtype`. An invalid value raises `ArgumentError` naming the flag."""
        try:
            return cls(device=device, dtype=dtype, max_batch_size=args.max_batch_size, eos_token_ids=eos_token_ids,
                       seed=args.seed, decode=decode, weight_version=args.weight_version, **_native_fields(args))
        except EngineOptionsError as exc:
            raise flag_error(exc) from None


def _native_fields(source: Any) -> dict[str, Any]:
    """The `NATIVE_FIELDS` options as `source` (the recipe section or the parsed flags) sets them."""
    return {name: getattr(source, name) for name in NATIVE_FIELDS}


def recipe_error(exc: EngineOptionsError) -> RecipeError:
    """`exc` naming the recipe field the option comes from (`from_recipe`'s options)."""
    return RecipeError.single(RECIPE_FIELDS.get(exc.field, exc.field), exc.value, exc.expected, exc.fix)


def flag_error(exc: EngineOptionsError) -> ArgumentError:
    """`exc` naming the `rl-core serve` flag the option comes from (`from_serve_args`' options)."""
    return ArgumentError(f"--{exc.field.replace('_', '-')}", exc.value, exc.expected, exc.fix, command="serve")
