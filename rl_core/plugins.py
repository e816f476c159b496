"""Plug-ins by import path: one loader for every user-supplied part.

Owns: `load_target("package.module:Name", field=..., kind=..., required=...)`, which imports
the module, finds the name and checks it is the right kind of object (a class or a callable)
with the members its protocol needs. Every failure is a `RecipeError` naming the recipe
field, the target and the fix, raised at recipe load (before any model is built). A target's
module is found through `sys.path`, else in the working directory (a console script or a
Snakemake `script:` does not put it on `sys.path`): added only while the named module
imports, so a file there never stands in for a package imported later (`import_target`).

Does not own: constructing the object (each part's factory does, with its own arguments).

Read more: docs/environments.md, "How your module is found".
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any, Iterable, Literal

from rl_core.errors import RecipeError


def split_target(target: Any, field: str) -> tuple[str, str]:
    """`"package.module:Name"` -> ("package.module", "Name"), or a RecipeError naming `field`."""
    if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
        raise RecipeError.single(field, target, "an import path 'package.module:Name'",
                                 "write the target as module:Name (for example my_tasks.envs:MyEnv).")
    module_name, name = target.split(":")
    return module_name, name


def import_target(module_name: str) -> Any:
    """Import `module_name` through `sys.path`; where its top-level package is not found there,
    with the working directory appended for this import only (after installed packages, so a
    local file never shadows one) and removed right after: a later import of a package that is
    not installed (say an optional `triton`) never runs a file that lies in the working directory."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    cwd = os.getcwd()
    top = module_name.split(".")[0]
    if "" in sys.path or cwd in sys.path or importlib.util.find_spec(top) is not None:
        return importlib.import_module(module_name)
    sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        while cwd in sys.path:
            sys.path.remove(cwd)
        importlib.invalidate_caches()


def load_target(target: str, *, field: str, kind: Literal["class", "callable"] = "class",
                required: Iterable[str] = (), what: str = "", hint: str = "") -> Any:
    """Import and check a plug-in.

    `kind`: "class" needs a class, "callable" a function (or any callable). `required`: member
    names the object must have (its protocol). `what` names the protocol in the error (e.g.
    "an Environment (rl_core.protocols.Environment)"); `hint` is the fix for a missing member.
    """
    module_name, name = split_target(target, field)
    try:
        module = import_target(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's module failed to import: a recipe error
        raise RecipeError.single(field, target, f"an importable module {module_name} ({type(exc).__name__}: {exc})",
                                 "check the module path and that its folder is on PYTHONPATH (or the working "
                                 "directory).") from None
    obj = getattr(module, name, None)
    if obj is None:
        raise RecipeError.single(field, target, f"a name {name} defined in module {module_name}",
                                 "check the spelling of the name after the colon.")
    if kind == "class" and not isinstance(obj, type):
        raise RecipeError.single(field, target, f"a class (got a {type(obj).__name__})",
                                 f"point {field} at the class itself.")
    if kind == "callable" and (isinstance(obj, type) or not callable(obj)):
        raise RecipeError.single(field, target, f"a function (got a {type(obj).__name__})",
                                 f"point {field} at a function.")
    missing = [m for m in required if not hasattr(obj, m)]
    if missing:
        raise RecipeError.single(field, target, f"{what or 'an object with the required members'}; missing: "
                                 f"{', '.join(missing)}", hint or "add the missing members.")
    return obj
