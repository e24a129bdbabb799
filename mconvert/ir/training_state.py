"""Training state beside the weights: optimizer moments, step, param-group settings, schedule, position, RNG.

What `--training-state` carries from one training checkpoint to another. The per-parameter tensors are kept
under the IR names of the weights they belong to and with the weights' shapes, so every loader and saver
reshards them by the same table as the weights (a moment is just another tensor of that name):

    fp32_param   the fp32 master copy (mixed-precision runs only; the weights themselves are bf16/fp16)
    exp_avg      Adam's first moment
    exp_avg_sq   Adam's second moment

Param groups and the schedule are stated in Megatron's terms (megatron-core is the yardstick): each group a torch
AdamW group with Megatron's `wd_mult`, `lr_mult`, `max_lr`, `min_lr`, ..., the schedule Megatron's
`opt_param_scheduler` state, counted in samples; other formats' loaders and savers translate (mtrain/run_state.py).
The rest is layout independent: the optimizer's param groups (their settings: lr, weight decay, betas, eps, ...,
and `step`, Adam's step count, which every parameter of a group shares), the LR/WD scheduler's state, the
iteration, the samples consumed and the grad scaler of fp16 runs. RNG states belong to the ranks that drew them:
a saver keeps them only for the layout they were saved in (`rng_layout`) and otherwise drops them with a note.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mconvert.errors import ConvertError, mismatch
from mconvert.ir.tensors import LazyTensor

MOMENTS = ("fp32_param", "exp_avg", "exp_avg_sq")
REQUIRED = ("exp_avg", "exp_avg_sq")  # Adam's; fp32_param only where the weights are half precision


@dataclass
class TrainingState:
    """The training state of one checkpoint (see the module docstring)."""

    tensors: dict[str, dict[str, LazyTensor]]  # moment (MOMENTS) -> {IR name: tensor}
    param_groups: list[dict[str, Any]]  # settings of each group, with its "step"; no parameter lists
    scheduler: dict[str, Any] | None
    iteration: int
    consumed_samples: int | None = None
    grad_scaler: dict[str, Any] | None = None
    rng: Any = None  # as the source stored it, meaningful only in `rng_layout`
    rng_layout: tuple[int, ...] | None = None  # (tp, pp, ...) the RNG states were drawn in
    optimizer_kind: str | None = None  # how the source stored it (e.g. Megatron's sharding type), for savers
    notes: list[str] = field(default_factory=list)
    # the run settings the schedule and groups are stated with, under Megatron's argument names (global_batch_size,
    # micro_batch_size, train_iters, clip_grad, optimizer, decoupled_weight_decay, seq_length), those the source has
    run: dict[str, Any] = field(default_factory=dict)

    @property
    def step(self) -> int:
        """Adam's step count: every group shares it in what Megatron and mtrain write."""
        steps = {int(g["step"]) for g in self.param_groups if g.get("step") is not None}
        return steps.pop() if len(steps) == 1 else self.iteration

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for moment in self.tensors.values() for t in moment.values())

    def check(self, weights: Mapping[str, LazyTensor], where: str) -> None:
        """Every moment must hold exactly the weights' names with the weights' shapes (one error lists every
        difference); Adam's two moments must be there; param groups must agree on their step."""
        absent = [m for m in REQUIRED if m not in self.tensors]
        if absent:
            raise ConvertError(f"{where}: the optimizer state has no {' or '.join(absent)}; this tool carries "
                               "Adam's state (exp_avg and exp_avg_sq)")
        problems = []
        for moment, tensors in self.tensors.items():
            if moment not in MOMENTS:
                raise ConvertError(f"{where}: unknown optimizer state {moment!r}; expected {', '.join(MOMENTS)}")
            missing = [n for n in weights if n not in tensors]
            extra = [n for n in tensors if n not in weights]
            if missing or extra:
                problems.append(f"{moment}: " + mismatch(missing, extra))
            problems += [f"{moment} of {n} is {list(t.shape)} ({t.origin}), the weight is {list(weights[n].shape)}"
                         for n, t in tensors.items() if n in weights and tuple(t.shape) != tuple(weights[n].shape)]
        if problems:
            raise ConvertError(f"{where}: the optimizer state does not match the weights: " + "; ".join(problems))
        if not self.param_groups:
            raise ConvertError(f"{where}: the optimizer state has no param groups")
        steps = {g.get("step") for g in self.param_groups}
        if len(steps) != 1:
            raise ConvertError(f"{where}: the param groups disagree on the step ({sorted(map(str, steps))}); "
                               "one step per run is what Megatron and mtrain resume from")

    def cast(self, weights: Mapping[str, LazyTensor], dtype: str) -> TrainingState:
        """The state beside `weights` cast to `dtype`: fp32 weights cast to half precision stay as the fp32 master
        weights (what a mixed-precision optimizer holds); cast to float32, the master weights become the weights
        (ModelIR.cast takes them) and leave the state."""
        masters = self.tensors.get("fp32_param")
        if dtype == "float32" and masters is not None:
            return dataclasses.replace(self, tensors={k: v for k, v in self.tensors.items() if k != "fp32_param"})
        if dtype != "float32" and masters is None and all(t.dtype_name == "float32" for t in weights.values()):
            return dataclasses.replace(self, tensors={**self.tensors, "fp32_param": dict(weights)})
        return self

    def check_groups(self, expected: int, what: str, where: str) -> None:
        """The number of param groups must be what the target optimizer builds for these parameters."""
        if len(self.param_groups) != expected:
            raise ConvertError(f"{where}: the optimizer state has {len(self.param_groups)} param groups, {what} "
                               f"has {expected}")


def decay_groups(names: Iterable[str], shapes: Mapping[str, tuple[int, ...]]) -> int:
    """How many param groups Megatron's default optimizer forms for a dense model's parameters: one with weight
    decay (matrices) and one without (biases and 1-d parameters), those kinds that exist."""
    kinds = {n.endswith(".bias") or len(shapes[n]) == 1 for n in names}
    return len(kinds)


def decays(group: dict[str, Any]) -> bool:
    """Does the param group decay its weights (Megatron's `wd_mult` not 0; absent means 1)?"""
    return float(group.get("wd_mult", 1.0)) != 0.0


def one_optimizer_groups(groups: list[dict[str, Any]], target: str = "the output's layout (EP1, expert TP = TP)"
                         ) -> list[dict[str, Any]]:
    """The param groups of one optimizer that serves dense and expert parameters alike: the groups megatron-core
    gives the experts' own optimizer (flagged `is_expert_parallel`) go into the dense group of the same weight decay
    (`wd_mult` 0 or not), which must have the same settings (one group then serves both); `target` names what
    has the one optimizer, for the error."""
    flagged = [g for g in groups if g.get("is_expert_parallel")]
    dense = [g for g in groups if not g.get("is_expert_parallel")]
    for g in flagged:
        twin = [d for d in dense if decays(d) == decays(g)]
        differ = sorted(k for k in set(g) | set(twin[0] if twin else {}) if k != "is_expert_parallel"
                        and (not twin or g.get(k) != twin[0].get(k)))
        if differ:
            raise ConvertError("--training-state: the experts' param group differs from the dense one of the same "
                               f"weight decay in {', '.join(differ)}; {target} gives the experts no optimizer of "
                               "their own, so one group must serve both")
    return dense
