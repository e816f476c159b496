"""Limits and silent accepts of issue 49: user data, user plug-ins and archives.

Each test feeds the real entry point (`rl-core validate` in this process, the loaders, the
plug-in loader, `rl-core inspect`) one bad input and checks that it is refused with one
paragraph naming the field or file, fast, before anything is built.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rl_core.launch.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-addition.yaml"
ROW = {"prompt": "07+45=", "answer": "250"}


def _validate(tmp_path: Path, body: str, capsys, *extra: str) -> tuple[int, str, float]:
    """`rl-core validate` on the default recipe plus `body`; (status, stderr, seconds)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"extends: {RECIPE}\noutput_dir: {tmp_path / 'out'}\n" + textwrap.dedent(body))
    capsys.readouterr()
    t0 = time.perf_counter()
    rc = main(["validate", str(recipe), *extra])
    return rc, capsys.readouterr().err, time.perf_counter() - t0


def _refused(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


# --------------------------------------------------------------------------- finding 4: data limits


def _big_rows(n_before: int = 10, size: int = 50 << 20) -> list[dict]:
    return [ROW] * n_before + [{"prompt": "7" * size, "answer": "1"}] + [ROW] * 10


@pytest.mark.parametrize("layout", ["one_group", "small_groups", "save_to_disk"])
def test_50mb_row_refused_by_validate(layout, tmp_path, capsys, monkeypatch):
    """A Parquet (or save_to_disk) row with a 50 MB prompt: refused by validate in seconds,
    naming the file and the row, as JSON lines are."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.chdir(ROOT)
    table = pa.Table.from_pylist(_big_rows(100))
    if layout == "save_to_disk":
        import datasets

        path = tmp_path / "train_ds"
        datasets.Dataset(table).save_to_disk(str(path))
        row = "row 101"
    else:
        path = tmp_path / "train.parquet"
        pq.write_table(table, path, row_group_size=len(table) if layout == "one_group" else 8)
        row = "row 101" if layout == "one_group" else "rows 97-104"  # the batch check, or the footer's
    rc, err, dt = _validate(tmp_path, f"data:\n  train_file: {path}\n", capsys)
    _refused(rc, err, "`data.train_file`", str(path), row, "1,048,576 bytes")
    assert dt < 10, f"took {dt:.1f} s"


def test_row_over_limit_inside_small_batch(tmp_path):
    """A 2 MB row among many small ones (the row group's average is under the limit): the
    batch check names the row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rl_core.data.dataset import count_examples
    from rl_core.errors import DataError

    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([ROW] * 300 + [{"prompt": "x" * (2 << 20), "answer": "1"}] + [ROW] * 3000),
                   path)
    with pytest.raises(DataError, match=r"t\.parquet, row 301: 2,097,\d+ bytes, longer than 1,048,576"):
        count_examples(path)
    pq.write_table(pa.Table.from_pylist([ROW] * 3000), path)
    assert count_examples(path) == 3000


# --------------------------------------------------------------------------- finding 7: plug-ins


def test_planted_module_in_working_directory_not_imported(tmp_path):
    """A recipe's plug-in in the working directory is found; a planted `triton.py` (a package
    torch imports optionally; a made-up name where triton is installed) beside it is never run
    by a later import."""
    import importlib.util

    name = "triton" if importlib.util.find_spec("triton") is None else "no_such_optional_package"
    marker = tmp_path / "planted_ran"
    (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (tmp_path / "my_rewards.py").write_text("def reward(prompt, completion, example):\n    return 1.0\n")
    script = textwrap.dedent(f"""
        from rl_core.plugins import load_target
        fn = load_target("my_rewards:reward", field="env.functions[0].target", kind="callable")
        assert fn(None, "", {{}}) == 1.0
        try:
            import {name}
        except ImportError:
            print("not importable")
        else:
            print("imported", {name}.__file__)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # -P: the interpreter does not add the working directory
    out = subprocess.run([sys.executable, "-P", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "not importable", out.stdout
    assert not marker.exists()


def test_huge_generate_refused_in_seconds(tmp_path, capsys, monkeypatch):
    """reasoning-gym `data.generate.num_train=1e8` is refused by validate with its bound, in
    seconds, before anything is generated; make-data refuses it too."""
    monkeypatch.chdir(ROOT)
    recipe = ROOT / "recipes" / "tiny-reasoning-gym.yaml"
    capsys.readouterr()
    t0 = time.perf_counter()
    rc = main(["validate", str(recipe), f"output_dir={tmp_path / 'out'}", "data.generate.num_train=100000000"])
    err, dt = capsys.readouterr().err, time.perf_counter() - t0
    _refused(rc, err, "`data.generate.num_train`", "100000000", "1000000")
    assert dt < 5, f"took {dt:.1f} s"
    rc = main(["make-data", "reasoning_gym", "--name", "chain_sum", "--num-train", "100000000",
               "--out", str(tmp_path / "rg")])
    err = capsys.readouterr().err
    _refused(rc, err, "--num-train", "1,000,000")
    assert not (tmp_path / "rg").exists() and not (tmp_path / "out").exists()
