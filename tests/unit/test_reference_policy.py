"""The KL reference is the run's initial policy, also after a resume from a checkpoint whose
weights have moved on (rl_core.train.make_trainer + rl_core.checkpoint.run_state)."""

from __future__ import annotations

import pytest
import torch

from rl_core.errors import CheckpointError
from rl_core.train import make_trainer

from tests.helpers.recipes import recipe
from tests.helpers.trainers import tiny_hf_dir


def _cfg(kl: float):
    return recipe(loss={"kl_coef": kl}, trainer={"backend": "torch"})


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_resumed_trainer_keeps_the_initial_policy_as_reference(tmp_path):
    initial = tiny_hf_dir(tmp_path / "initial", seed=0)
    later = tiny_hf_dir(tmp_path / "later", seed=1)  # stands for a checkpoint's trained weights
    fresh = make_trainer(_cfg(0.1), initial, device="cpu")
    assert fresh.reference_dir == str(initial.resolve())
    state = {k: v for k, v in fresh.state_dict().items()}
    state["reference_dir"] = fresh.reference_dir  # what save_run_checkpoint records
    resumed = make_trainer(_cfg(0.1), later, device="cpu", trainer_state=state)
    want, got, policy = _weights(fresh.reference), _weights(resumed.reference), _weights(resumed.model)
    assert all(torch.equal(want[k], got[k]) for k in want), "reference must be the initial policy"
    assert any(not torch.equal(policy[k], got[k]) for k in policy), "the policy itself is the checkpoint's"
    assert resumed.reference_dir == str(initial.resolve())


def test_no_reference_without_kl_and_a_missing_reference_is_named(tmp_path):
    initial = tiny_hf_dir(tmp_path / "initial")
    assert make_trainer(_cfg(0.0), initial, device="cpu").reference_dir is None
    state = dict(make_trainer(_cfg(0.1), initial, device="cpu").state_dict())
    state["reference_dir"] = str(tmp_path / "gone")
    with pytest.raises(CheckpointError, match="gone.*moved or deleted"):
        make_trainer(_cfg(0.1), initial, device="cpu", trainer_state=state)
