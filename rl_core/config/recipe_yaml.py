"""Strict YAML for recipes and command-line override values.

Owns: turning recipe bytes into plain data (dicts with string keys, lists, str, int, float,
bool, None) or a `RecipeError` paragraph naming the file and where in it: UTF-8 only (the
byte offset and line of the first bad byte), at most `MAX_RECIPE_BYTES`; a key given twice
in one mapping (both lines named); anchors and aliases within `MAX_EXPANDED_NODES` and
`MAX_ALIASES` (an alias bomb fails at once); dates stay strings (an unquoted ISO date as
`run_name` is a name, not a `datetime.date`); values JSON cannot hold (`!!binary`, `!!set`,
non-string keys) and an empty document are errors.

Does not own: `extends:` resolution, overrides or the schema (`loader.py`, `schema.py`).

Read more: docs/usage.md, "Recipes" (what is checked before anything is built).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from rl_core.errors import RecipeError

MAX_RECIPE_BYTES = 1 << 20
"""Largest recipe file read (1 MiB); real recipes are a few KiB."""
MAX_EXPANDED_NODES = 100_000
"""Most YAML nodes a document may hold once every alias is expanded."""
MAX_ALIASES = 1_000
"""Most alias uses (`*name`) in one document."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader with alias accounting and no timestamp type (duplicates: `_check_duplicates`)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.alias_count = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.alias_count += 1
            if self.alias_count > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise _Limit(f"more than {MAX_ALIASES} aliases (*name)", mark)
        return super().compose_node(parent, index)


class _Limit(Exception):
    def __init__(self, what: str, mark):
        self.what, self.mark = what, mark


class _Duplicate(Exception):
    def __init__(self, key, first, again):
        self.key, self.first, self.again = key, first, again


_MERGE = "tag:yaml.org,2002:merge"


def _check_duplicates(node: Node, path: str, seen_nodes: set[int]) -> None:
    """Raise `_Duplicate` (with the dotted path) for a key given twice in one mapping. Keys that
    a `<<:` merge brings in may be overridden on purpose and are not duplicates."""
    if id(node) in seen_nodes or isinstance(node, ScalarNode):
        return
    seen_nodes.add(id(node))
    if isinstance(node, SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicates(item, f"{path}[{i}]", seen_nodes)
        return
    keys: dict[str, Node] = {}
    for key_node, value_node in node.value:
        if key_node.tag == _MERGE:
            _check_duplicates(value_node, path, seen_nodes)
            continue
        name = key_node.value if isinstance(key_node, ScalarNode) else None
        child = f"{path}.{name}" if path and name is not None else (name or path)
        if name is not None:
            if name in keys:
                raise _Duplicate(child, keys[name].start_mark, key_node.start_mark)
            keys[name] = key_node
        _check_duplicates(value_node, child, seen_nodes)


# Dates and times stay strings: remove the implicit timestamp resolver (a copy per class).
# Booleans are YAML 1.2's: only true/false (any case); yes/no/on/off stay strings, so that
# `logging.progress: off` is the documented value "off", not false.
_BOOL_12 = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_StrictLoader.yaml_implicit_resolvers = {
    ch: [(tag, _BOOL_12 if tag == "tag:yaml.org,2002:bool" else rx) for tag, rx in resolvers
         if tag != "tag:yaml.org,2002:timestamp"]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _expanded_size(node: Node, memo: dict[int, int], budget: int) -> int:
    """Nodes under `node` with aliases expanded (memoised per node object, so it is linear in
    the distinct nodes); stops counting once `budget` is exceeded."""
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = budget + 1  # a node reached again while being counted: a recursive alias
    if isinstance(node, ScalarNode):
        size = 1
    else:
        children = node.value if isinstance(node, SequenceNode) else [n for kv in node.value for n in kv]
        size = 1
        for child in children:
            size += _expanded_size(child, memo, budget)
            if size > budget:
                break
    memo[key] = size
    return size


def _where(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _plain(value: Any, path: str, source: str | None) -> Any:
    """Check that `value` is JSON-like data; name the first path that is not."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise RecipeError.single(f"{path}.{k}" if path else str(k), k,
                                         f"a string key (got a {type(k).__name__} key)",
                                         "quote the key (YAML reads true/false as booleans and digits as numbers).",
                                         source=source)
            _plain(v, f"{path}.{k}" if path else k, source)
        return value
    if isinstance(value, list):
        for i, v in enumerate(value):
            _plain(v, f"{path}[{i}]", source)
        return value
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise RecipeError.single(path or "(top level)", value,
                             f"a string, number, boolean, null, list or mapping (got YAML type {type(value).__name__})",
                             "write the value as plain YAML (no !!binary, !!set or other tags).", source=source)


_RAISE = object()


def parse_yaml(text: str, source: str | None, what: str = "(YAML syntax)", on_syntax_error: Any = _RAISE) -> Any:
    """Parse one YAML document strictly (see the module docstring); `None` for an empty one.
    `on_syntax_error`, when given, is returned for text that is not YAML at all (an override
    value such as `a: b: c` is then taken as a string); the limits still raise."""
    loader = _StrictLoader(text)
    try:
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            memo: dict[int, int] = {}
            size = _expanded_size(node, memo, MAX_EXPANDED_NODES)
            if size > MAX_EXPANDED_NODES:
                raise _Limit(f"more than {MAX_EXPANDED_NODES:,} values once its aliases (*name) are expanded "
                             "(or an alias that refers to itself)", node.start_mark)
            _check_duplicates(node, "", set())
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except _Duplicate as dup:
        key = f"{what}.{dup.key}" if what != "(YAML syntax)" else dup.key
        raise RecipeError.single(key, dup.key.rsplit(".", 1)[-1],
                                 f"each key once per mapping (it is at {_where(dup.first)} "
                                 f"and again at {_where(dup.again)})",
                                 "remove one of the two; YAML would silently keep only the last.", source=source) from None
    except _Limit as lim:
        raise RecipeError.single("(YAML aliases)", f"a document with {lim.what}", "a recipe of plain values "
                                 f"(at most {MAX_ALIASES} aliases and {MAX_EXPANDED_NODES:,} values expanded)",
                                 f"write the values out; the document grows past the limit near {_where(lim.mark)}.",
                                 source=source) from None
    except RecursionError:
        raise RecipeError.single("(YAML syntax)", "a deeply nested document", "a recipe nested a few levels deep",
                                 "flatten the YAML.", source=source) from None
    except yaml.YAMLError as exc:
        if on_syntax_error is not _RAISE:
            return on_syntax_error
        mark = getattr(exc, "problem_mark", None)
        at = f" at {_where(mark)}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError.single(what, problem, f"valid YAML{at}",
                                 "fix the indentation or quoting there.", source=source) from None
    return _plain(data, "", source)


def read_recipe_text(path: Path) -> str:
    """The recipe file's text: at most MAX_RECIPE_BYTES, strict UTF-8 (errors name the byte offset)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_RECIPE_BYTES + 1)
    except OSError as exc:
        raise RecipeError.single("(recipe file)", str(path), "a readable YAML recipe file",
                                 f"check its permissions ({exc.strerror}).") from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise RecipeError.single("(recipe file)", str(path), f"a recipe of at most {MAX_RECIPE_BYTES:,} bytes",
                                 "point at the YAML recipe (not a data or model file).", source=str(path))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise RecipeError.single("(recipe file)", raw[exc.start: exc.start + 4],
                                 f"UTF-8 text (byte offset {exc.start}, line {line} is not UTF-8)",
                                 "re-save the recipe as UTF-8.", source=str(path)) from None
