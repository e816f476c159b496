"""Plug-ins by import path: one loader for every user-supplied part.

Owns: `load_target("package.module:Name", field=..., kind=..., required=...)`, which imports
the module, finds the name and checks it is the right kind of object (a class or a callable)
with the members its protocol needs. Every failure is a `RecipeError` naming the recipe
field, the target and the fix, raised at recipe load (before any model is built). A target's
module is found through `sys.path`; the working directory is appended when missing (a
console script or a Snakemake `script:` does not put it there).

Does not own: constructing the object (each part's factory does, with its own arguments).

Read more: docs/environments.md, "How your module is found".
"""

from __future__ import annotations

import importlib
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


def load_target(target: str, *, field: str, kind: Literal["class", "callable"] = "class",
                required: Iterable[str] = (), what: str = "", hint: str = "") -> Any:
    """Import and check a plug-in.

    `kind`: "class" needs a class, "callable" a function (or any callable). `required`: member
    names the object must have (its protocol). `what` names the protocol in the error (e.g.
    "an Environment (rl_core.protocols.Environment)"); `hint` is the fix for a missing member.
    """
    module_name, name = split_target(target, field)
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)  # after installed packages: a local file never shadows one
    try:
        module = importlib.import_module(module_name)
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
