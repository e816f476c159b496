"""`snakemake --cores 2` of the short recipe end to end (tiny model, warm-up, 2 epochs): every
output exists and is what it claims to be, the report shows the plots, a second run has
nothing to do, and the documented rerun commands plan the promised jobs."""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys

import matplotlib.image as mpimg

from tests.helpers.workflow import PLOTS, RUN, copy_run, job_stats, manifest, short_config, snakemake

EPOCHS = 2
STEPS_PER_EPOCH = 6


def test_every_output_exists(reference_run):
    r = reference_run / "results" / RUN
    assert json.loads((r / "resolved_config.json").read_text())["run_name"] == RUN
    assert (r / "init_policy" / "config.json").is_file() and (r / "init_policy" / "model.safetensors").is_file()
    assert json.loads((r / "init_validation.json").read_text())["weight_version"] == 0
    for k in range(1, EPOCHS + 1):
        e = r / f"epoch_{k}"
        m = manifest(e / "checkpoint")
        assert m["rl_step"] == k * STEPS_PER_EPOCH
        assert {"model/model.safetensors", "model/config.json", "optimizer.pt", "rng.pt", "controller_state.json",
                "buffer.json", "resolved_config.json"} <= set(m["files"])
        assert not (e / "steps").exists(), "step checkpoints are removed once the epoch checkpoint is complete"
        summary = json.loads((e / "summary.json").read_text())
        assert (summary["first_step"], summary["end_step"]) == ((k - 1) * STEPS_PER_EPOCH, k * STEPS_PER_EPOCH)
        val = json.loads((e / "validation.json").read_text())
        assert val["weight_version"] == k * STEPS_PER_EPOCH and 0.0 <= val["accuracy"] <= 1.0 and "pass@1" in val
        steps = [json.loads(line)["step"] for line in (e / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "train"]
        assert steps == list(range((k - 1) * STEPS_PER_EPOCH + 1, k * STEPS_PER_EPOCH + 1))
        assert (e / "rollouts.h5").is_file()
    ev = json.loads((r / "evaluation.json").read_text())
    assert set(ev["checkpoints"]) == {"final", "best"} and ev["checkpoints"]["final"]["epoch"] == EPOCHS
    assert ev["k"] == 4 and all("pass@4" in row and row["num_prompts"] == 64 for row in ev["results"])
    for rule in ("validate_recipe", "init_policy", "train_epoch_1", "train_epoch_2", "archive_rollouts_1",
                 "validate_epoch_2", "validate_init", "evaluate", "report"):
        log = (r / "logs" / f"{rule}.log").read_text()
        assert log.startswith("=== ") and "done" in log.splitlines()[-1], rule
    train_log = (r / "logs" / "train_epoch_1.log").read_text()
    assert "[submit] epoch 1: local job" in train_log and "[train] step 6/12" in train_log  # numbered as in metrics.jsonl


def test_checkpoint_is_a_loadable_hf_model(reference_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_core.checkpoint import verify_checkpoint

    ck = reference_run / "results" / RUN / f"epoch_{EPOCHS}" / "checkpoint"
    verify_checkpoint(ck)
    model = AutoModelForCausalLM.from_pretrained(str(ck / "model"))
    tok = AutoTokenizer.from_pretrained(str(ck / "model"))
    assert model.num_parameters() > 100_000 and tok.decode(tok.encode("07+45=")) == "07+45="


def test_report_shows_every_plot(reference_run):
    r = reference_run / "results" / RUN
    html = (r / "report.html").read_text()
    uris = re.findall(r'<figure id="(\w+)"><img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert [name for name, _ in uris] == list(PLOTS)
    for name, b64 in uris:
        png = (r / "report" / f"{name}.png").read_bytes()
        assert base64.b64decode(b64) == png
        assert mpimg.imread(io.BytesIO(png), format="png").shape[1] > 500
    assert "Evaluation (k = 4)" in html and "validation accuracy before RL" in html


def test_inspect_reads_the_archive(reference_run):
    out = subprocess.run([sys.executable, "-m", "rl_core.launch.cli", "inspect",
                          f"results/{RUN}/epoch_1/rollouts.h5", "--num-samples", "3"],
                         cwd=reference_run, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "6 steps [1, 6], 48 groups, 192 samples" in out.stdout  # RL steps as in metrics.jsonl
    assert "decoded with results/short/epoch_1/checkpoint/model" in out.stdout
    assert out.stdout.count("[step 1 ") == 3


def test_second_run_has_nothing_to_do(reference_run):
    out = snakemake(reference_run, "-n", "--cores", "2", *short_config())
    assert out.returncode == 0 and "Nothing to be done" in out.stdout + out.stderr


def test_documented_rerun_commands_plan_the_right_jobs(reference_run, tmp_path):
    wd = copy_run(reference_run, tmp_path / "wd")
    # (b) re-validate one checkpoint: only that validation
    out = snakemake(wd, "-n", "--cores", "2", *short_config(), "--force", f"results/{RUN}/epoch_1/validation.json")
    assert out.returncode == 0 and job_stats(out.stdout) == {"validate_epoch": 1}, out.stdout
    # (b) re-evaluate: the evaluation and the report
    out = snakemake(wd, "-n", "--cores", "2", *short_config(), "--forcerun", "evaluate")
    assert out.returncode == 0 and job_stats(out.stdout) == {"evaluate": 1, "report": 1, "all": 1}, out.stdout
    # (c) force epoch 2 and everything downstream
    out = snakemake(wd, "-n", "--cores", "2", *short_config(), "--forcerun", f"results/{RUN}/epoch_2/checkpoint")
    assert out.returncode == 0, out.stderr
    assert job_stats(out.stdout) == {"train_epoch": 1, "archive_rollouts": 1, "validate_epoch": 1, "evaluate": 1,
                                     "report": 1, "all": 1}, out.stdout


def test_every_computing_rule_wrote_its_benchmark(reference_run):
    """Snakemake's `benchmark:` of each computing rule: wall time and memory of the finished job."""
    bench = reference_run / "results" / RUN / "benchmarks"
    names = ["init_policy", "validate_init", "evaluate", "report"]
    names += [f"{rule}_{k}" for k in range(1, EPOCHS + 1) for rule in ("train_epoch", "archive_rollouts",
                                                                        "validate_epoch")]
    assert sorted(p.stem for p in bench.glob("*.tsv")) == sorted(names)
    for name in names:
        header, row = (bench / f"{name}.tsv").read_text().splitlines()[:2]
        cols = dict(zip(header.split("\t"), row.split("\t")))
        assert float(cols["s"]) > 0 and "max_rss" in cols, (name, cols)
