"""The import rules of rl_core's layers, checked on the source (AST only, nothing imported).

- every import (module level, inside functions, under `if TYPE_CHECKING:`) points down the
  layer table of docs/architecture.md ("## Layers", read here: the one source of the order),
  and the import graph has no circle, within a layer either (`layering_problems`);
- no module outside rl_core/launch imports rl_core.launch (the launch layer is the top);
- rl_core/checkpoint imports nothing from rl_core.controller (the checkpoint format sits
  below the controller that decides when to take one);
- no `from rl_core.x import _private` across modules (a module's underscore names are its own),
  in rl_core and in the tests;
- no module reads another object's private attribute (`obj._name` with `obj` other than
  `self`/`cls`), except the third-party ones listed in `THIRD_PARTY_PRIVATE` (torch and os
  offer no public spelling for them);
- vLLM (an optional install) is imported only inside functions of rl_core.generation.vllm;
- no Python file of the repository exceeds 600 lines.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "rl_core"
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"
MAX_MODULE_LINES = 600


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=None)
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def modules(pkg: Path = PKG) -> dict[str, Path]:
    return {module_name(p, pkg.parent): p for p in sorted(pkg.rglob("*.py"))}


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
    """(line, imported module, names imported from it) for each import of `path`: every one, or
    with `top_level_only` those that run when the module is imported (not inside functions or
    under `if TYPE_CHECKING:`; inside module-level `try`/`if` blocks they run and count)."""
    tree = parse(path)
    out: list[tuple[int, str, list[str]]] = []
    if not top_level_only:  # every import statement, wherever it stands
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out.extend((node.lineno, a.name, []) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                out.append((node.lineno, resolve_from(mod, path, node), [a.name for a in node.names]))
        return out

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                out.extend((node.lineno, a.name, []) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                out.append((node.lineno, resolve_from(mod, path, node), [a.name for a in node.names]))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
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
    ("rl_core/usercode.py", "os._exit"),  # the watchdog's exit when the event loop is blocked (documented API)
    ("rl_core/envs/service.py", "os._exit"),  # a forked child whose parent is already gone (documented API)
    ("rl_core/usercode.py", "sys._current_frames"),
    # openai's client resolves its platform headers in a worker thread at its first call; each
    # episode's new client is handed the value an earlier one resolved (no public setting for it)
    ("rl_core/envs/agent.py", "client._platform"),  # another thread's stack: the documented way to read it
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
    # and its THD (packed) function, swapped for the same unfused one at each token's position
    # during a packed forward (trainer.packing); rope_utils calls this module global too
    ("rl_core/train/megatron.py", "rope_utils._apply_rotary_pos_emb_thd"),
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


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of `graph` with more than one node: each holds one
    circle or several."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    components: list[set[str]] = []
    for a in sorted(graph):
        component = {a} | {b for b in reach[a] if a in reach[b]}
        if len(component) > 1 and component not in components:
            components.append(component)
    return components


def import_edges(pkg: Path = PKG) -> list[tuple[str, int, str]]:
    """(module, line, module that import loads) for every import of every module of `pkg`,
    lazy ones included (inside functions, under `if TYPE_CHECKING:`). A package's `__init__`
    runs before any of its submodules, so importing `a.b.c` also loads `a.b` and `a`: those
    are loaded too (a module's own ancestors are left out: a parent package importing its own
    submodule is the normal order of loading, not a circle)."""
    known = modules(pkg)
    out: dict[tuple[str, int, str], None] = {}
    for mod, path in known.items():
        ancestors = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
        for line, imported, names in imports(path, mod, top_level_only=False):
            for target in rl_core_targets(imported, names, known):
                parts = target.split(".")
                for t in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
                    if t in known and t != mod and t not in ancestors:
                        out[(mod, line, t)] = None
    return list(out)


def documented_layers(doc: Path = ARCHITECTURE_DOC) -> list[list[str]]:
    """The layer table of docs/architecture.md ("## Layers"): per row, bottom first, its
    backticked modules and packages (names under rl_core/)."""
    section = doc.read_text().split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| *(\d+) *\|([^|\n]*)\|", section, flags=re.M)
    assert [int(n) for n, _ in rows] == list(range(1, len(rows) + 1)), "layer rows are numbered 1, 2, ... bottom first"
    return [re.findall(r"`([A-Za-z_][\w.]*)`", names) for _, names in rows]


def layering_problems(pkg: Path, layers: list[list[str]]) -> list[str]:
    """What breaks the layer order `layers` (bottom first; names relative to the package `pkg`,
    a package's layer is every module in it) in the source under `pkg`, every import counted:
    a module in no layer, each import of a higher layer, each circle of the import graph (one
    per strongly connected component, within a layer too), and each circle between the
    table's entries (two packages of one layer importing each other, even through modules
    that form no circle). The root package is below every layer."""
    level = {f"{pkg.name}.{name}": i + 1 for i, names in enumerate(layers) for name in names}

    def entry(mod: str) -> str | None:  # the longest listed prefix
        parts = mod.split(".")
        return next((p for p in (".".join(parts[:i]) for i in range(len(parts), 1, -1)) if p in level), None)

    def layer(mod: str) -> int | None:
        return 0 if mod == pkg.name else level.get(entry(mod))

    known = modules(pkg)
    problems = [f"{mod} is in no layer" for mod in known if layer(mod) is None]
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, line, target in import_edges(pkg):
        graph[mod].add(target)
        here, there = layer(mod), layer(target)
        if here is not None and there is not None and there > here:
            problems.append(f"{known[mod].relative_to(pkg.parent)}:{line} imports {target} (layer {there}) "
                            f"from layer {here}")
    for component in strongly_connected(graph):
        problems.append("import circle: " + " -> ".join(find_cycle({n: graph[n] & component for n in component})))
    entries: dict[str, set[str]] = {e: set() for e in level}
    for mod, targets in graph.items():
        if entry(mod) is not None:
            entries[entry(mod)] |= {entry(t) for t in targets} - {None, entry(mod)}
    for component in strongly_connected(entries):
        problems.append("circle between packages: " +
                        " -> ".join(find_cycle({n: entries[n] & component for n in component})))
    return problems


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_layer_table_names_each_module_once():
    names = [name for row in documented_layers() for name in row]
    known = modules()
    unknown = [name for name in names if f"rl_core.{name}" not in known]
    assert len(documented_layers()) >= 5 and not unknown and len(names) == len(set(names)), (unknown, names)


def test_every_import_points_down_the_documented_layers_and_closes_no_circle():
    problems = layering_problems(PKG, documented_layers())
    assert not problems, ("imports against the layer order of docs/architecture.md (## Layers), or import "
                          "circles, every import counted (inside functions and under TYPE_CHECKING too); move "
                          "the shared piece down to where both sides may import it:\n" + "\n".join(problems))


TREE_LAYERS = [["errors"], ["config"], ["data", "envs"], ["launch"]]


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """A package `rl_core` of `files` (path -> source) under `root`; returns the package folder."""
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / "rl_core" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "rl_core"


def test_the_layer_checker_passes_a_tree_that_keeps_the_order(tmp_path):
    pkg = write_tree(tmp_path, {
        "errors.py": "", "config/__init__.py": "from rl_core.errors import RecipeError\n",
        "data/__init__.py": "", "data/files.py": "from rl_core import config\n",
        "envs/__init__.py": "from rl_core.data.files import load\n", "launch.py": "import rl_core.envs\n"})
    assert layering_problems(pkg, TREE_LAYERS) == []


def test_the_layer_checker_finds_planted_upward_imports(tmp_path):
    """Lazy imports count: one inside a function, one under TYPE_CHECKING; a module outside the table too."""
    pkg = write_tree(tmp_path, {
        "errors.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rl_core.config import Recipe\n",
        "config/__init__.py": "def preflight():\n    from rl_core.envs import load_agent\n",
        "data/__init__.py": "", "envs/__init__.py": "", "launch.py": "", "stray.py": ""})
    assert layering_problems(pkg, TREE_LAYERS) == [
        "rl_core.stray is in no layer",
        "rl_core/config/__init__.py:2 imports rl_core.envs (layer 3) from layer 2",
        "rl_core/errors.py:3 imports rl_core.config (layer 2) from layer 1"]


def test_the_layer_checker_finds_planted_circles(tmp_path):
    """Within a layer imports may go either way, never both: a circle of modules (data.files ->
    envs -> data.files, one side of it lazy), and, in a second tree, a circle of the layer's
    packages through modules that close none (data.files -> envs.base, envs.agent -> data.files)."""
    pkg = write_tree(tmp_path / "a", {
        "errors.py": "", "config/__init__.py": "", "launch.py": "", "data/__init__.py": "",
        "data/files.py": "def load():\n    from rl_core.envs import make_env\n",
        "envs/__init__.py": "from rl_core.data.files import load\n"})
    assert layering_problems(pkg, TREE_LAYERS) == [
        "import circle: rl_core.data.files -> rl_core.envs -> rl_core.data.files",
        "circle between packages: rl_core.data -> rl_core.envs -> rl_core.data"]
    pkg = write_tree(tmp_path / "b", {
        "errors.py": "", "config/__init__.py": "", "launch.py": "", "data/__init__.py": "",
        "data/files.py": "from rl_core.envs.base import Env\n", "envs/__init__.py": "", "envs/base.py": "",
        "envs/agent.py": "def run():\n    from rl_core.data.files import load\n"})
    assert layering_problems(pkg, TREE_LAYERS) == ["circle between packages: rl_core.data -> rl_core.envs -> rl_core.data"]


def test_no_python_file_exceeds_600_lines():
    """A module past 600 lines holds a second concept: split it where the concepts part."""
    long = [f"{path.relative_to(ROOT)} ({n} lines)"
            for folder in ("rl_core", "tests", "bench", "examples", "workflow")
            for path in sorted((ROOT / folder).rglob("*.py"))
            if (n := path.read_bytes().count(b"\n")) > MAX_MODULE_LINES]
    assert not long, f"Python files over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


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
