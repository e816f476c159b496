"""Damaged checkpoints stop the stage that reads them with an error naming the file."""

from __future__ import annotations

from tests.helpers.workflow import RUN, copy_run, short_config, snakemake


def test_truncated_weights_stop_validation_naming_the_file(reference_run, tmp_path):
    wd = copy_run(reference_run, tmp_path / "wd")
    r = wd / "results" / RUN
    weights = r / "epoch_1" / "checkpoint" / "model" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as fh:
        fh.truncate(size // 2)
    (r / "epoch_1" / "validation.json").unlink()
    out = snakemake(wd, "--cores", "2", f"results/{RUN}/epoch_1/validation.json", *short_config())
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert (f"validate_epoch: Checkpoint file results/{RUN}/epoch_1/checkpoint/model/model.safetensors has "
            f"{size // 2} bytes; the manifest says {size}") in text, text[-3000:]
    assert not (r / "epoch_1" / "validation.json").exists()


def test_manifest_mismatch_stops_training_naming_the_file(reference_run, tmp_path):
    wd = copy_run(reference_run, tmp_path / "wd")
    r = wd / "results" / RUN
    opt = r / "epoch_1" / "checkpoint" / "optimizer.pt"
    data = bytearray(opt.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    opt.write_bytes(bytes(data))
    out = snakemake(wd, "--cores", "2", *short_config(), "--forcerun", f"results/{RUN}/epoch_2/checkpoint",
                    "--until", "train_epoch")
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert f"Checkpoint file results/{RUN}/epoch_1/checkpoint/optimizer.pt does not match its sha256" in text, \
        text[-3000:]
    assert "train_epoch: Training epoch 2 (job" in text
