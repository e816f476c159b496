"""Reading, overriding, validating and writing recipes.

Owns: YAML parsing (with `extends:` to build a recipe on another one), dotted
command-line overrides (`grpo.max_num_steps=300`), turning pydantic's errors into one
`RecipeError` paragraph per problem (field, value, expectation, fix), the checks that read
one file or directory the recipe names (an HF policy's architecture, a writable output
directory), and writing `resolved_config.json` atomically.

Does not own: the schema itself (`schema.py`), anything that needs torch, or the preflight
of data files and plug-ins (rl_core.launch.preflight: it imports the parts' packages).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from rl_core.config.base import BoolNotNumber
from rl_core.config.recipe_yaml import parse_yaml, read_recipe_text
from rl_core.config.schema import RecipeConfig, check_moe_rules
from rl_core.errors import RecipeError
from rl_core.fsutil import atomic_write_text

RESOLVED_CONFIG = "resolved_config.json"
MAX_EXTENDS_DEPTH = 16
_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
"""Longest chain of `extends:`."""


# --------------------------------------------------------------------------- YAML + overrides


def recipes_hint() -> str:
    """Where to find a recipe, for an error about a missing one: the recipes/ folder of the working
    directory when it has one (a clone, a project of `rl-core new`), else how to get one."""
    here = Path("recipes")
    found = sorted(str(p) for p in here.glob("*.yaml")) if here.is_dir() else []
    if found:
        return f"the recipes in {here.resolve()}/ are {', '.join(found)}"
    return (f"{Path.cwd()} has no recipes/ folder; `rl-core new DIR` writes a project with the shipped recipes "
            "(DIR/recipes/) and their data, to run from DIR")


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    if not path.is_file():
        if chain:
            raise RecipeError.single("extends", str(path), "an existing YAML recipe file to build on",
                                     "fix the `extends:` path (relative paths are relative to the recipe that extends).",
                                     source=str(chain[-1]))
        raise RecipeError.single("(recipe file)", str(path), "an existing YAML recipe file",
                                 f"check the path; {recipes_hint()}.")
    if path.resolve() in chain:
        raise RecipeError.single("extends", str(path), "no cycle of `extends:`", "remove the cyclic extends.",
                                 source=str(chain[-1]))
    if len(chain) >= MAX_EXTENDS_DEPTH:
        raise RecipeError.single("extends", str(path), f"a chain of at most {MAX_EXTENDS_DEPTH} recipes",
                                 "build on fewer recipes.", source=str(chain[-1]))
    data = parse_yaml(read_recipe_text(path), source=str(path))
    if data is None:
        raise RecipeError.single("(recipe file)", str(path), "a recipe with at least one setting (the file is empty)",
                                 "write the settings, or `extends: tiny-addition.yaml` to start from a shipped recipe "
                                 "(`{}` runs every default on purpose).", source=str(path))
    if not isinstance(data, dict):
        raise RecipeError.single("(top level)", data, "a mapping of sections (model:, grpo:, ...)",
                                 "write the recipe as `section: {key: value}` YAML.", source=str(path))
    if "extends" not in data:
        return data
    base = data.pop("extends")
    if not isinstance(base, str) or not base.strip():
        raise RecipeError.single("extends", base, "the path of another YAML recipe (a string)",
                                 "write `extends: other.yaml` (relative to this recipe), or remove it.", source=str(path))
    parent = _read_yaml((path.parent / base), chain + (path.resolve(),))
    return deep_merge(parent, data)


def deep_merge(base: dict, top: dict) -> dict:
    """`top` wins; dicts merge recursively, everything else is replaced. A section whose
    `type:` changes (e.g. another sampler) replaces the base section instead of merging."""
    out = dict(base)
    for k, v in top.items():
        switched = isinstance(v, dict) and isinstance(out.get(k), dict) and "type" in v and v["type"] != out[k].get("type")
        if isinstance(v, dict) and isinstance(out.get(k), dict) and not switched:
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` strings (value parsed as YAML: numbers, bools, null, lists)."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for item in overrides:
        if "=" not in item:
            raise RecipeError.single("(override)", item, "KEY=VALUE with a dotted key, e.g. grpo.max_num_steps=300",
                                     "write the override as section.field=value.")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(_KEY.match(part) for part in parts):
            raise RecipeError.single("(override)", item, "KEY=VALUE whose dotted key names fields "
                                     "(letters, digits, _ and -, e.g. grpo.max_num_steps=300)",
                                     "fix the key left of `=` (`rl-core docs` lists every field).", source="(command line)")
        # the value is YAML (numbers, bools, null, lists); text that is not valid YAML stays a string
        value = parse_yaml(raw, source="(command line)", what=key.strip(), on_syntax_error=raw) if raw != "" else ""
        node = data
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if parts[-1] == "type" and node.get("type") not in (None, value):
            node.clear()  # switching a section's type starts it afresh (its old keys belong to the old type)
        node[parts[-1]] = value
    return data


# --------------------------------------------------------------------------- pydantic errors -> RecipeError


def _is_union(annotation) -> bool:
    """A union of several types (`X | None` is not: pydantic puts no tag in its error locations)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _is_union(typing.get_args(annotation)[0])
    return origin in (typing.Union, types.UnionType) and len([a for a in typing.get_args(annotation)
                                                              if a is not type(None)]) > 1


def _unwrap(annotation, tag=None):
    """The model class behind a field annotation (picking the union member whose `type` is `tag`)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0], tag)
    if origin in (list, tuple, dict) and typing.get_args(annotation):  # an item's model (`env.functions[0]`)
        return _unwrap(typing.get_args(annotation)[-1 if origin is dict else 0], tag)
    members = [annotation]
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(members) > 1 or tag is not None:
        models = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
        for m in models:
            t = m.model_fields.get("type")
            if t is not None and t.default == tag:
                return m
        return models[0] if models else None
    return members[0]


def _walk(loc: tuple) -> tuple[list[str], Any]:
    """Map a pydantic error location to the user's dotted path; also return the model owning the last key."""
    names: list[str] = []
    model: Any = RecipeConfig
    owner: Any = RecipeConfig
    pending_union = None
    for i, part in enumerate(loc):
        if pending_union is not None:  # pydantic inserts the discriminator tag into the location
            model, pending_union = _unwrap(pending_union, part), None
            continue
        if isinstance(part, int):
            names[-1:] = [f"{names[-1]}[{part}]"] if names else [f"[{part}]"]
            continue
        names.append(str(part))
        owner = model
        if isinstance(model, type) and issubclass(model, BaseModel) and part in model.model_fields:
            info = model.model_fields[part]
            ann = info.annotation
            if (info.discriminator or _is_union(ann)) and i + 1 < len(loc) and not isinstance(loc[i + 1], int):
                pending_union = ann
            model = _unwrap(ann)
        else:
            model = None
    return names, owner


def _problem(err: dict) -> list[dict]:
    ctx = err.get("ctx") or {}
    inner = ctx.get("error")
    if isinstance(inner, RecipeError):
        return inner.problems
    loc = tuple(err["loc"])
    if isinstance(inner, BoolNotNumber):  # raised by a section for one of its keys
        loc = loc + (inner.key,)
    names, owner = _walk(loc)
    if isinstance(inner, BoolNotNumber):
        path = ".".join(names)
        return [{"field": path, "value": inner.value, "expected": inner.expected,
                 "fix": f"write a value of the field's type for `{path}` (`rl-core docs` lists it), or remove it for the default."}]
    path = ".".join(names) or "(top level)"
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        key = str(loc[-1])
        valid = sorted(owner.model_fields) if isinstance(owner, type) and issubclass(owner, BaseModel) else []
        close = difflib.get_close_matches(key, valid, n=1)
        where = ".".join(names[:-1]) or "the top level"
        hint = f"did you mean `{close[0]}`? " if close else ""
        return [{"field": path, "value": value, "missing": False,
                 "expected": f"one of the known keys of {where}: {', '.join(valid)}",
                 "fix": f"{hint}remove or rename `{key}` (`rl-core docs` lists every field)."}]
    if kind == "missing":
        return [{"field": path, "value": None, "missing": True, "expected": "a value (this field is required)",
                 "fix": f"add `{path}` to the recipe."}]
    if kind == "union_tag_invalid":
        return [{"field": path + ".type", "value": ctx.get("tag"), "expected": f"one of {ctx.get('expected_tags')}",
                 "fix": "set `type:` to one of the listed values."}]
    msg = err["msg"]
    for prefix in ("Input should be ", "Value error, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    return [{"field": path, "value": value, "expected": msg,
             "fix": f"change `{path}` in the recipe or on the command line (`{path}=...`)."}]


def _default_tags(data: Any, model: Any = RecipeConfig) -> None:
    """Give a discriminated section without `type:` the type of its default (e.g. sampler -> in_order)."""
    if not isinstance(data, dict) or not (isinstance(model, type) and issubclass(model, BaseModel)):
        return
    for name, info in model.model_fields.items():
        sub = data.get(name)
        if not isinstance(sub, dict):
            continue
        if info.discriminator and "type" not in sub and isinstance(info.default, BaseModel):
            sub["type"] = info.default.type
        _default_tags(sub, _unwrap(info.annotation, sub.get("type")))


def validate_dict(data: dict, source: str | None = None) -> RecipeConfig:
    data = json.loads(json.dumps(data))
    _default_tags(data)
    try:
        return RecipeConfig.model_validate(data)
    except ValidationError as exc:
        problems: list[dict] = []
        for err in exc.errors(include_url=False):
            problems.extend(_problem(err))
        raise RecipeError(problems, source) from None
    except RecipeError as exc:  # raised by a validator outside pydantic's wrapping
        exc.source = exc.source or source
        raise RecipeError(exc.problems, source) from None


# --------------------------------------------------------------------------- public entry points


def read_recipe(path: str | os.PathLike, overrides: list[str] | None = None) -> RecipeConfig:
    """parse -> override -> validate. Raises RecipeError; reads nothing but the recipe files (the
    file-system and plug-in checks before a run: rl_core.launch.preflight.load_recipe)."""
    data = _read_yaml(Path(path))
    data = apply_overrides(data, list(overrides or []))
    return validate_dict(data, source=str(path))


def hf_architecture(path: str | os.PathLike | None) -> tuple[str, bool] | None:
    """(model_type, is a mixture of experts) from `path`/config.json, or None when that file
    cannot be read here (e.g. a path on the cluster's file system, checked when loaded)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    return str(cfg.get("model_type")), bool(cfg.get("num_local_experts") or cfg.get("num_experts"))


def check_model_architecture(cfg: RecipeConfig, source: str | None = None) -> None:
    """The recipe rules that depend on an HF policy's architecture (MoE, router replay), read
    from `model.path`/config.json when this machine can read it (`schema.check_moe_rules`)."""
    if cfg.model.source != "hf":
        return
    try:
        check_moe_rules(cfg, hf_architecture(cfg.model.path))
    except RecipeError as exc:
        raise RecipeError(exc.problems, exc.source or source) from None


def check_output_dir(path: str | os.PathLike, field: str, source: str | None = None) -> None:
    """`path` is a directory rl_core can create or write into: no part of it is a file, and
    the nearest existing directory is writable. Nothing is created here."""
    p = Path(path).absolute()
    for here in [p, *p.parents]:
        if not os.path.lexists(here):
            continue
        if not here.is_dir():
            raise RecipeError.single(field, str(path), f"a directory path (but {here} is a file)",
                                     "choose another directory, or move that file away.", source)
        if not os.access(here, os.W_OK | os.X_OK):
            what = "write into" if here == p else f"create {p.relative_to(here)} in"
            raise RecipeError.single(field, str(path), f"a directory rl_core can {what} ({here} is not writable)",
                                     "choose a directory you can write to.", source)
        return


def run_dir(cfg: RecipeConfig) -> Path:
    return Path(cfg.output_dir) / cfg.run_name


def write_resolved(cfg: RecipeConfig, directory: str | os.PathLike, field: str = "output_dir") -> Path:
    path = Path(directory) / RESOLVED_CONFIG
    try:
        atomic_write_text(path, json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n")
    except OSError as exc:
        raise RecipeError.single(field, str(directory), "a directory rl_core can create and write "
                                 f"resolved_config.json into ({type(exc).__name__}: {exc.strerror or exc})",
                                 "choose another output_dir (or --out), or free space / fix permissions there.") from None
    return path


def load_resolved(path: str | os.PathLike) -> RecipeConfig:
    """Load a resolved_config.json (written by write_resolved) back into a RecipeConfig."""
    p = Path(path)
    if p.is_dir():
        p = p / RESOLVED_CONFIG
    if not p.is_file():
        raise RecipeError.single("(resolved config)", str(p), "an existing resolved_config.json",
                                 "run `rl-core validate RECIPE` first or pass the right path.")
    cfg = validate_dict(json.loads(p.read_text()), source=str(p))
    check_model_architecture(cfg, source=str(p))
    return cfg
