"""LoRA adapters in the trainers (`trainer.lora`), with PEFT.

Owns: the policy a trainer builds (`load_policy`: the HF model, with PEFT's LoRA layers injected
in place when `trainer.lora.enabled` and every base weight frozen; A initialised from a fixed
seed, so every backend starts from the same adapters without drawing from the run's RNG; from
a LoRA checkpoint, its base model and the saved adapters), and, over a model's state dict or
named tensors (so FSDP2's gathered ones work alike): the adapters in the refit format
(`LoraPolicy.refit_adapters`), the merged full weights under HF names (`LoraPolicy.merged`), the
base-only forward of the KL reference (`LoraPolicy.base_only`), saving the adapters as a PEFT
directory beside the base model's identity (`LoraPolicy.save`).

Does not own: the optimizer or the step (torch_trainer.py, fsdp.py), the formats and the base's
identity (rl_core.adapters). Read more: docs/lora.md.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from rl_core.adapters import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, LORA_A, LORA_B, PEFT_PREFIX, is_adapter_dir,
                              merged_weight, resolve_base, write_base_identity)
from rl_core.errors import CheckpointError, RecipeError

ADAPTER = "default"  # PEFT's adapter name: parameters are `<module>.lora_A.default.weight`
INIT_SEED = 0
_A, _B, _BASE = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight", ".base_layer."


def peft_config(cfg) -> Any:
    """PEFT's `LoraConfig` of the recipe's `trainer.lora` section."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise RecipeError.single("trainer.lora.enabled", True, "the `peft` package installed (LoRA adapters are "
                                 "PEFT's)", "pip install 'rl_core[lora]' (or -c constraints.txt peft), or set "
                                 "trainer.lora.enabled: false.") from None
    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                      bias="none", task_type="CAUSAL_LM")


class LoraPolicy:
    """The LoRA side of a trainer's model (see the module doc); `model` is the HF model with
    PEFT's layers injected (its forward is the adapted policy), `base_dir` the frozen base."""

    def __init__(self, model: torch.nn.Module, peft_model: Any, cfg, base_dir: Path):
        from peft.tuners.lora import LoraLayer

        self.model, self.peft_model, self.cfg, self.base_dir = model, peft_model, cfg, base_dir
        self.scales: dict[str, float] = {}
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                base = getattr(module, "base_layer", None)
                if not isinstance(base, torch.nn.Linear) or ADAPTER not in module.lora_A:
                    raise RecipeError.single("trainer.lora.target_modules", cfg.target_modules,
                                             f"linear layers only ({name} is a {type(base).__name__})",
                                             "name linear layers (q_proj, v_proj, ...) or use all-linear.")
                self.scales[name] = float(module.scaling[ADAPTER])
        if not self.scales:
            raise RecipeError.single("trainer.lora.target_modules", cfg.target_modules,
                                     "module names that match linear layers of the policy",
                                     "use all-linear, or names such as q_proj, k_proj, v_proj, o_proj.")

    # ------------------------------------------------------------------ tensors

    def refit_adapters(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The adapters in the refit format from the model's (full) named LoRA tensors."""
        out = {}
        for name, t in named:
            if name.endswith(_A):
                out[name[:-len(_A)] + LORA_A] = t.detach()
            elif name.endswith(_B):
                module = name[:-len(_B)]
                out[module + LORA_B] = t.detach() * self.scales[module]
        return out

    def merged(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full weights under HF names from the model's (full) state dict: the base weights with
        each adapter's scaled B @ A added; tied tensors stay shared."""
        out = {}
        for name, t in state.items():
            if name.endswith(_A) or name.endswith(_B):
                continue
            out[name.replace(_BASE, ".")] = t.detach()
        for module, scale in self.scales.items():
            out[f"{module}.weight"] = merged_weight(state[f"{module}.base_layer.weight"], state[module + _A],
                                                    state[module + _B] * scale)
        return out

    @staticmethod
    def is_lora_name(name: str) -> bool:
        return name.endswith(_A) or name.endswith(_B)

    # ------------------------------------------------------------------ forward modes

    @contextlib.contextmanager
    def base_only(self) -> Iterator[None]:
        """Forward without the adapters (the KL reference: the run's initial policy is the base)."""
        self.peft_model.base_model.disable_adapter_layers()
        try:
            yield
        finally:
            self.peft_model.base_model.enable_adapter_layers()

    @contextlib.contextmanager
    def inference(self) -> Iterator[None]:
        """Logprob passes without the adapters' dropout (a no-op when `trainer.lora.dropout` is 0)."""
        if not self.cfg.dropout or not self.model.training:
            yield
            return
        self.model.eval()
        try:
            yield
        finally:
            self.model.train()

    @contextlib.contextmanager
    def passes(self, reference: bool) -> Iterator[None]:
        """Context of one forward: without dropout when no gradient is taken (logprob passes),
        without the adapters for the KL reference (`reference`, the base model)."""
        with contextlib.ExitStack() as modes:
            if not torch.is_grad_enabled():
                modes.enter_context(self.inference())
            if reference:
                modes.enter_context(self.base_only())
            yield

    # ------------------------------------------------------------------ files

    def save(self, out_dir: str | Path, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The adapters (named full LoRA tensors) as a PEFT directory: adapter_config.json,
        adapter_model.safetensors, the base's config.json (what rl_core's checks read) and
        `base_model.json` (rl_core.adapters: the base's path, model type and sha256)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, t in named:
            for suffix, peft_suffix in ((_A, ".lora_A.weight"), (_B, ".lora_B.weight")):
                if name.endswith(suffix):
                    tensors[PEFT_PREFIX + name[:-len(suffix)] + peft_suffix] = t.detach().to("cpu").contiguous()
        save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = self.peft_model.peft_config[ADAPTER]
        config.base_model_name_or_path = str(self.base_dir)
        config.inference_mode = True
        config.save_pretrained(str(out))
        for name in ("config.json", "generation_config.json"):
            if (self.base_dir / name).is_file():
                shutil.copyfile(self.base_dir / name, out / name)
        write_base_identity(out, self.base_dir)


def _check_saved(adapter_dir: Path, cfg) -> None:
    """A LoRA checkpoint's adapters must have the recipe's rank, alpha and targets."""
    saved = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    want = peft_config(cfg)
    targets = lambda t: sorted(t) if isinstance(t, (list, set, tuple)) else t  # noqa: E731
    for field, got, expected in (("rank", saved.get("r"), want.r), ("alpha", saved.get("lora_alpha"), want.lora_alpha),
                                 ("target_modules", targets(saved.get("target_modules")), targets(want.target_modules))):
        if got != expected and not (field == "target_modules" and want.target_modules == "all-linear"):
            raise RecipeError.single(f"trainer.lora.{field}", expected, f"{got!r}, as the adapters saved in "
                                     f"{adapter_dir} (a run resumes or branches with the adapters' own shape)",
                                     f"set trainer.lora.{field}: {got!r}, or start a new run.")


def load_adapter_tensors(adapter_dir: Path, model: torch.nn.Module) -> None:
    """Copy a PEFT directory's A and B matrices into the model's LoRA parameters (all of them)."""
    from safetensors.torch import load_file

    saved = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    params = {n: p for n, p in model.named_parameters() if LoraPolicy.is_lora_name(n)}
    state = {}
    for name, t in saved.items():
        key = name[len(PEFT_PREFIX):].replace(".lora_A.weight", _A).replace(".lora_B.weight", _B)
        if key not in params or params[key].shape != t.shape:
            raise CheckpointError(f"{adapter_dir / ADAPTER_WEIGHTS} holds {name} {tuple(t.shape)}, which is not a "
                                  "LoRA parameter of the recipe's policy. Fix: resume with the recipe the adapters "
                                  "were trained with.")
        state[key] = t
    if set(params) - set(state):
        raise CheckpointError(f"{adapter_dir / ADAPTER_WEIGHTS} lacks {sorted(set(params) - set(state))[:3]}. Fix: "
                              "resume from another checkpoint.")
    with torch.no_grad():
        for key, t in state.items():
            params[key].copy_(t)


def base_dir_of(policy_dir: str | Path, verify: bool = True) -> Path:
    """The directory of full weights behind `policy_dir`: its base model for a LoRA adapter
    directory (rl_core.adapters.resolve_base), else itself."""
    return resolve_base(policy_dir, verify) if is_adapter_dir(policy_dir) else Path(policy_dir).resolve()


def load_policy(policy_dir: str | Path, cfg, load: Callable[[Path], torch.nn.Module]
                ) -> tuple[torch.nn.Module, LoraPolicy | None]:
    """The model a trainer trains from `policy_dir` (an HF directory, or a LoRA checkpoint's
    adapter directory), with `load(dir)` building the HF model: plain when `cfg.enabled` is
    false, else with LoRA layers injected (the base frozen, a checkpoint's adapters copied in)."""
    policy_dir = Path(policy_dir)
    saved = is_adapter_dir(policy_dir)
    if not cfg.enabled:
        if saved:
            raise RecipeError.single("trainer.lora.enabled", False, f"true: {policy_dir} holds LoRA adapters (a run "
                                     "with trainer.lora on wrote it)", "set trainer.lora.enabled: true with the "
                                     "adapters' rank and targets, or start from a full-weight policy.")
        return load(policy_dir), None
    if saved:
        _check_saved(policy_dir, cfg)
    base_dir = base_dir_of(policy_dir)
    model = load(base_dir)
    return attach(model, cfg, base_dir, policy_dir if saved else None)


def attach(model: torch.nn.Module, cfg, base_dir: Path, adapter_dir: Path | None = None
           ) -> tuple[torch.nn.Module, LoraPolicy]:
    """Inject LoRA layers into `model` in place (A from `INIT_SEED`, B zero; the run's RNG is
    left as it was), freeze the base, then copy saved adapters from `adapter_dir` if given."""
    from peft import get_peft_model

    config = peft_config(cfg)
    devices = [model.device] if model.device.type != "meta" else []
    with torch.random.fork_rng(devices=[d for d in devices if d.type == "cuda"]):
        torch.manual_seed(INIT_SEED)
        peft_model = get_peft_model(model, config)
    hf = peft_model.get_base_model()
    policy = LoraPolicy(hf, peft_model, cfg, Path(base_dir))
    if adapter_dir is not None:
        load_adapter_tensors(adapter_dir, hf)
    return hf, policy
