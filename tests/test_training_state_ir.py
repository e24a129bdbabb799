"""The training state's own checks (mconvert.ir.training_state), format aside: moments against the weights."""

from __future__ import annotations

import pytest
import torch

from mconvert.errors import ConvertError
from mconvert.ir.tensors import LazyTensor
from mconvert.ir.training_state import TrainingState, decay_groups

WEIGHTS = {"embed.weight": LazyTensor.of(torch.zeros(8, 4)), "final_norm.weight": LazyTensor.of(torch.zeros(4))}


def state(tensors=None, groups=None) -> TrainingState:
    moments = tensors if tensors is not None else {
        m: {n: LazyTensor.of(torch.zeros(t.shape), f"{m}:{n}") for n, t in WEIGHTS.items()}
        for m in ("exp_avg", "exp_avg_sq")}
    return TrainingState(moments, groups or [{"lr": 1.0, "step": 3.0}, {"lr": 1.0, "step": 3.0}], None, 3)


def test_a_matching_state_passes():
    s = state()
    s.check(WEIGHTS, "here")
    assert s.step == 3


def test_missing_extra_and_misshapen_moments_are_listed_together():
    s = state()
    del s.tensors["exp_avg"]["final_norm.weight"]
    s.tensors["exp_avg"]["lm_head.weight"] = LazyTensor.of(torch.zeros(8, 4))
    s.tensors["exp_avg_sq"]["embed.weight"] = LazyTensor.of(torch.zeros(8, 5), "file:exp_avg_sq.embed")
    with pytest.raises(ConvertError) as e:
        s.check(WEIGHTS, "here")
    message = str(e.value)
    for part in ("final_norm.weight", "lm_head.weight", "exp_avg_sq of embed.weight is [8, 5]", "[8, 4]"):
        assert part in message, message


def test_adam_moments_are_required():
    with pytest.raises(ConvertError, match="no exp_avg_sq"):
        state({"exp_avg": {n: t for n, t in WEIGHTS.items()}}).check(WEIGHTS, "here")


def test_groups_must_agree_on_the_step_and_count():
    with pytest.raises(ConvertError, match="disagree on the step"):
        state(groups=[{"step": 3.0}, {"step": 4.0}]).check(WEIGHTS, "here")
    with pytest.raises(ConvertError, match="3 param groups, the target has 2"):
        state(groups=[{"step": 3.0}] * 3).check_groups(2, "the target", "here")


def test_decay_groups():
    shapes = {n: t.shape for n, t in WEIGHTS.items()}
    assert decay_groups(WEIGHTS, shapes) == 2
    assert decay_groups(["embed.weight"], shapes) == 1
