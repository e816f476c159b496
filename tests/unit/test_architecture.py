"""The import rules of rl_core's layers, checked on the source (AST only, nothing imported).

- no module outside rl_core/launch imports rl_core.launch (the launch layer is the top);
- rl_core/checkpoint imports nothing from rl_core.controller (the checkpoint format sits
  below the controller that decides when to take one);
- no `from rl_core.x import _private` across modules (a module's underscore names are its own),
  in rl_core and in the tests;
- no module reads another object's private attribute (`obj._name` with `obj` other than
  `self`/`cls`), except the third-party ones listed in `THIRD_PARTY_PRIVATE` (torch and os
  offer no public spelling for them);
- no import cycle among rl_core modules at module level (imports inside functions and under
  `if TYPE_CHECKING:` are lazy and do not count);
- vLLM (an optional install) is imported only inside functions of rl_core.generation.vllm.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "rl_core"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=None)
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def resolve_from(mod: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module of a `from X import ...` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_package(path) else mod.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, mod: str, top_level_only: bool) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names imported from it) for each import of `path`.
    `top_level_only`: skip imports inside functions and under `if TYPE_CHECKING:` (lazy ones);
    imports inside module-level `try`/`if` blocks still run at import time and count."""
    tree = parse(path)
    out: list[tuple[int, str, list[str]]] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                out.extend((node.lineno, a.name, []) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                out.append((node.lineno, resolve_from(mod, path, node), [a.name for a in node.names]))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                if not top_level_only:
                    visit(node.body)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                if not top_level_only:
                    visit(node.body)
                visit(node.orelse)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    child = getattr(node, field, None)
                    if isinstance(child, list):
                        visit([c for c in child if isinstance(c, ast.stmt)] +
                              [s for h in child if isinstance(h, ast.ExceptHandler) for s in h.body])

    visit(tree.body)
    return out


def rl_core_targets(imported: str, names: list[str], known: dict[str, Path]) -> list[str]:
    """The rl_core modules an import loads: `from pkg import sub` loads pkg.sub when it is a module."""
    if not (imported == "rl_core" or imported.startswith("rl_core.")):
        return []
    targets = [imported] if imported in known else []
    targets += [f"{imported}.{n}" for n in names if f"{imported}.{n}" in known]
    return targets


def test_nothing_outside_launch_imports_launch():
    bad = []
    for mod, path in modules().items():
        if mod == "rl_core.launch" or mod.startswith("rl_core.launch."):
            continue
        for line, imported, _ in imports(path, mod, top_level_only=False):
            if imported == "rl_core.launch" or imported.startswith("rl_core.launch."):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not bad, "rl_core.launch is the top layer; these modules import it:\n" + "\n".join(bad)


def test_checkpoint_imports_nothing_from_controller():
    bad = []
    for mod, path in modules().items():
        if not mod.startswith("rl_core.checkpoint"):
            continue
        for line, imported, _ in imports(path, mod, top_level_only=False):
            if imported == "rl_core.controller" or imported.startswith("rl_core.controller."):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not bad, "rl_core.checkpoint sits below the controller:\n" + "\n".join(bad)


def test_no_private_names_imported_across_modules():
    bad = []
    for mod, path in modules().items():
        for line, imported, names in imports(path, mod, top_level_only=False):
            if not imported.startswith("rl_core"):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and imported != mod:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {', '.join(private)} from {imported}")
    assert not bad, "underscore names are private to their module; make them public or keep them local:\n" + \
        "\n".join(bad)


def test_tests_import_no_private_names():
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rl_core"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {', '.join(private)} from {node.module}")
    assert not bad, "tests use rl_core's public names only:\n" + "\n".join(bad)


# `expression` read in `file`: private names of third-party libraries with no public equivalent
THIRD_PARTY_PRIVATE = {
    # whether a tokenizer class overrides transformers' Rust-backed decode step (group_decoder
    # reproduces only the unmodified one); transformers has no public spelling for that method
    ("rl_core/rollout/decode.py", "TokenizersBackend._decode"),
    ("rl_core/launch/workflow.py", "os._exit"),  # documented public API despite the underscore
    ("rl_core/launch/completion.py", "p._actions"),  # argparse has no public accessor for a parser's arguments
    ("rl_core/train/fsdp.py", "torch._foreach_mul_"),  # fused in-place scaling of the gradient list
    ("rl_core/train/fsdp.py", "t._local_tensor"),  # DTensor's local shard; to_local() adds an autograd node per call
    ("rl_core/train/megatron.py", "torch._foreach_mul_"),  # gradient clipping over the list in one multi-tensor op
    ("rl_core/train/megatron.py", "torch._foreach_copy_"),  # fp32 main -> bf16 model weights in one multi-tensor op
    ("rl_core/train/update.py", "torch._foreach_mul_"),  # the gradients scaled by 1 / normalizer in one multi-tensor op
    # Megatron's Float16 optimizer calls this method inside step_with_ready_grads; no public hook replaces it
    ("rl_core/train/megatron.py", "opt._copy_main_params_to_model_params"),
    # Megatron's unfused rotary function, swapped for its compiled self during the forward
    # (apply_rope_fusion would need Transformer Engine; rope_utils calls this module global)
    ("rl_core/train/megatron.py", "rope_utils._apply_rotary_pos_emb_bshd"),
    ("rl_core/train/spmd.py", "distributed_c10d._get_default_group"),
    ("rl_core/train/spmd.py", "distributed_c10d._get_default_store"),
    ("rl_core/weights/broadcast.py", "opts._timeout"),  # ProcessGroupNCCL.Options has no public timeout setter
    # Dynamo's recompile limit has no public setter; torch's own error message points to it
    ("rl_core/generation/native/decode_graph.py", "torch._dynamo"),
}


def test_no_private_attribute_reads_across_objects():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(parse(path)):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            expr = ast.unparse(node)
            if (rel, expr) not in THIRD_PARTY_PRIVATE:
                bad.append(f"{rel}:{node.lineno} reads {expr}")
    assert not bad, "read other objects through their public methods and properties:\n" + "\n".join(bad)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {n: WHITE for n in graph}
    for start in sorted(graph):
        if color[start] != WHITE:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        path = [start]
        color[start] = GREY
        while stack:
            node, todo = stack[-1]
            if todo:
                nxt = todo.pop(0)
                if color.get(nxt, BLACK) == GREY:
                    return path[path.index(nxt):] + [nxt]
                if color.get(nxt) == WHITE:
                    color[nxt] = GREY
                    path.append(nxt)
                    stack.append((nxt, sorted(graph[nxt])))
            else:
                color[node] = BLACK
                path.pop()
                stack.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """rl_core module -> rl_core modules it imports at module level. A package's `__init__`
    runs before any of its submodules, so importing `a.b.c` also loads `a.b` and `a`: those
    edges are added too (a parent package importing its own submodule is the normal order of
    loading, not a cycle, so a module's own ancestors are left out)."""
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        ancestors = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
        for _, imported, names in imports(path, mod, top_level_only=True):
            for target in rl_core_targets(imported, names, known):
                parts = target.split(".")
                chain = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
                graph[mod] |= {t for t in chain if t in known and t != mod and t not in ancestors}
    return graph


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_at_module_level():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle among rl_core modules (module-level imports): " + " -> ".join(cycle)


def test_vllm_is_imported_only_lazily_and_only_by_generation_vllm():
    """vLLM is an optional install: only `rl_core.generation.vllm` imports it, inside functions
    (the registry's `vllm` builder is the one way in)."""
    bad = []
    for mod, path in modules().items():
        lazy = {line for line, imported, _ in imports(path, mod, top_level_only=False)
                if imported == "vllm" or imported.startswith("vllm.")}
        eager = {line for line, imported, _ in imports(path, mod, top_level_only=True)
                 if imported == "vllm" or imported.startswith("vllm.")}
        inside = mod.startswith("rl_core.generation.vllm.")
        bad += [f"{path.relative_to(ROOT)}:{line} imports vllm" + (" at module level" if inside else "")
                for line in sorted(eager if inside else lazy)]
    assert not bad, "vLLM may be imported only inside functions of rl_core.generation.vllm:\n" + "\n".join(bad)
