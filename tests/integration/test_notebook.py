"""examples/notebook.ipynb, executed by a real Jupyter kernel (nbclient + ipykernel): the Python
API trains the short recipe inside the kernel's running event loop and prints the headline."""

from __future__ import annotations

import json
import shutil

import nbformat
from nbclient import NotebookClient

from tests.helpers.paths import ROOT


def _text(cell) -> str:
    return "".join(o.get("text", "") + "".join(o.get("data", {}).get("text/plain", ""))
                   for o in cell.get("outputs", []))


def test_the_notebook_trains_the_short_recipe_in_a_real_kernel(tmp_path, warm_policy):
    for name in ("recipes", "data"):  # a project folder: the clone's recipes and data, results here
        (tmp_path / name).symlink_to(ROOT / name)
    run = tmp_path / "results" / "tiny-addition-short"
    shutil.copytree(warm_policy, run / "init_policy")  # the session's warmed-up policy (same model), reused
    nb = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    # first, proof that this kernel runs cells on a running event loop (where asyncio.run fails)
    nb.cells.insert(0, nbformat.v4.new_code_cell("import asyncio\nprint('loop running:', "
                                                 "asyncio.get_running_loop().is_running())"))
    NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    texts = [_text(c) for c in nb.cells if c.cell_type == "code"]
    assert "loop running: True" in texts[0]
    assert str(tmp_path) in texts[1]  # the notebook found the project folder it runs in
    assert "held-out accuracy:" in texts[2] and "after 12 RL steps" in texts[2], texts[2]
    assert "final_policy" in texts[3] and "'rl_steps': 12" in texts[3]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rl_steps"] == 12
    assert (run / "final_policy" / "model.safetensors").is_file()
