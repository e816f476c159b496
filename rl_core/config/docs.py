"""Reference documentation of every recipe field, generated from the schema.

Owns: walking the pydantic models and printing each field's dotted path, type, default
and docstring (`rl-core docs`, and docs/recipe-reference.md which a test keeps in sync).
Does not own: the fields themselves (schema.py).
"""

from __future__ import annotations

import typing

from pydantic import BaseModel

from rl_core.config.schema import RecipeConfig


def _type_name(ann) -> str:
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(ann)[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(ann))
    if origin in (typing.Union, __import__("types").UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(ann))
    if origin is list:
        return f"list[{', '.join(_type_name(a) for a in typing.get_args(ann))}]"
    if ann is type(None):
        return "null"
    return getattr(ann, "__name__", str(ann))


def _models(ann) -> list[type[BaseModel]]:
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return _models(typing.get_args(ann)[0])
    if origin in (typing.Union, __import__("types").UnionType):
        return [m for a in typing.get_args(ann) for m in _models(a)]
    return [ann] if isinstance(ann, type) and issubclass(ann, BaseModel) else []


def _rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        subs = _models(info.annotation)
        if subs:
            for sub in subs:
                tag = sub.model_fields.get("type")
                label = f"{path}" + (f" (type: {tag.default})" if tag is not None and len(subs) > 1 else "")
                doc = (sub.__doc__ or "").strip().splitlines()[0]
                if len(subs) == 1 and info.description and type(None) in typing.get_args(info.annotation):
                    doc = f"{doc} {info.description.strip()}"  # an optional section: what it is here, what null means
                rows.append((label, "section", "", doc))
                rows.extend(_rows(sub, f"{path}."))
        else:
            default = info.default
            rows.append((path, _type_name(info.annotation), repr(default), (info.description or "").strip()))
    return rows


def render_docs(fmt: str = "text") -> str:
    rows = _rows(RecipeConfig, "")
    if fmt == "markdown":
        out = ["# Recipe reference", "", "Generated from `rl_core/config/schema.py` by `rl-core docs --format markdown`.",
               "", "| field | type | default | meaning |", "|---|---|---|---|"]
        for path, typ, default, doc in rows:
            if typ == "section":
                out.append(f"| **{path}** | section | | {doc} |")
            else:
                out.append(f"| `{path}` | {typ.replace('|', '&#124;')} | `{default}` | {doc.replace('|', '&#124;')} |")
        return "\n".join(out) + "\n"
    out = []
    for path, typ, default, doc in rows:
        if typ == "section":
            out.append(f"\n[{path}] {doc}")
        else:
            out.append(f"  {path}: {typ} = {default}\n      {doc}")
    return "\n".join(out).lstrip("\n") + "\n"
