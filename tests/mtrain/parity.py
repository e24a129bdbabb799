"""How close a parallel layout's float32 run must come to one process's: bounds measured from float32 itself.

A parallel layout computes the same function as one process with its sums taken in other orders (a tensor-parallel
shard's partial products, then an all-reduce; FSDP's reduce-scatter; context parallel's split sequences; a
pipeline's accumulation), so both float32 runs carry rounding errors of the same size. No fixed tolerance describes
that size well: Adam's m / (sqrt(v) + eps) turns the last bits of gradient entries near zero (or near eps) into
learning-rate-sized steps, and how much depends on the data, the model and the CPU's kernels (AVX-512, AVX2 and
plain kernels sum in other orders). So the reference (`Reference`, built by RecordingTrainer.reference) runs the one
process

    in float64 (recording.to_dtype: the same initial weights, data and float32 rotary tables; float64 holds every
        float32 value and rounds 2^29 times more finely): the exact answer, for this purpose;
    in float32: what a layout must match;
    in float32 three more times, the same steps with their sums in other orders (`DRAWS`): micro-batches in reverse
        order, samples of each micro-batch in reverse order (sums over tokens: FSDP's and context parallel's kind),
        every matrix product as 2 x 2 blocks (sums over features: tensor parallel's kind, `SplitReductions`).

The four float32 runs' largest distance from float64, tensor by tensor, is float32's own error `err_t`, and

    |layout - fp32| <= |layout - exact| + |fp32 - exact|            (triangle inequality; fp64 ~ exact)
    bound_t = K * err_t + FLOOR_ULPS * eps32 * max|fp64_t|

The layout is one more float32 evaluation with its sums in another order, so its distance from the exact answer is
of the size of the draws': the difference is about twice err_t. One draw alone is not enough: the largest entry of a
tensor is often one amplified entry, which a single run may happen to round almost exactly (measured: a layout 20
times one draw's error away, 1.9 times the four draws'). K = 8 leaves a factor of 4 over that twice (measured on
this suite, AVX-512: every tensor of every layout within 0.37 of its bound, at step 1 within 0.2). The floor of 4
float32 ulps of the tensor's largest entry serves tensors that the draws happen to round exactly.

What the bounds still catch: a tensor off by a factor of 2, a partial sum (a missing all-reduce), a wrong shard
move a tensor by about its own size, max|fp64_t|, and every bound but those of noise-determined tensors stays
below SENSITIVE = 1e-2 of its tensor's size (checked by Reference.worst; measured: below 1e-5 at step 1, 2.4e-3 at
most after 4 steps), so such a bug overshoots its bound 100 times or more. Noise-determined tensors are those whose
exact value is rounding-sized, e.g. a key bias's gradient (it shifts every score of a query alike, so its exact
gradient is 0) and, through Adam, that bias's weights: float32's error there is as large as the tensor, and so is
the bound, as it must be; tests name them.

Losses (scalars) get K times float32's own error plus LOSS_FLOOR_ULPS = 16 ulps of the loss (2e-6 relative), for
steps where every draw happens to round close to the exact loss: measured differences stay below one ulp, and a
wrong layout changes a loss in its leading digits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mtrain.train import RunResult

EPS32 = torch.finfo(torch.float32).eps  # 2^-23: float32's unit in the last place at 1
K = 8.0  # bound = K x float32's own error + the floor
FLOOR_ULPS = 4.0  # the tensors' floor: ulps of the largest entry
LOSS_FLOOR_ULPS = 16.0  # the losses' floor: ulps of the loss
SENSITIVE = 1e-2  # no bound but those of noise-determined tensors may exceed this fraction of its tensor's size
DRAWS = ("micro", "samples", "features")  # the reordered float32 runs besides the plain one (RecordingTrainer)


class Reordered:
    """The same global batches with their micro-batches in reverse order ("micro") or the samples of each micro-batch
    in reverse order ("samples"): the same training step in exact arithmetic (the losses, the auxiliary loss's
    statistics and the expert loads are sums over a micro-batch's tokens), its sums over tokens taken in another
    order."""

    def __init__(self, batches, how: str):
        self.batches, self.how = batches, how

    def next(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        micro = self.batches.next()
        if self.how == "micro":
            return micro[::-1]
        return [(x.flip(0), y.flip(0)) for x, y in micro]

    def __getattr__(self, name):
        return getattr(self.batches, name)


def split_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (b 2-D) as 2 x 2 blocks: the reduction in halves added up (as tensor parallel adds partial products),
    the output columns in halves (so that backward's reduction over them splits too)."""
    k, n = b.shape
    if k < 2 or n < 2:
        return a @ b
    half = [a[..., :k // 2] @ b[:k // 2, cols] + a[..., k // 2:] @ b[k // 2:, cols]
            for cols in (slice(0, n // 2), slice(n // 2, n))]
    return torch.cat(half, dim=-1)


class SplitReductions(TorchFunctionMode):
    """Every linear layer and matrix product with a 2-D right side computed by split_matmul: the same function in
    exact arithmetic, its sums over features rounded in another order."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w, bias = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias")
            y = split_matmul(x, w.T)
            return y if bias is None else y + bias
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and args[1].dim() == 2:
            return split_matmul(args[0], args[1])
        return func(*args, **kwargs)


def at(record: dict, where: tuple) -> dict[str, torch.Tensor]:
    """The tensors of a record (recording.RecordingTrainer.run_and_record) at ("grads", step) or ("weights",)."""
    for key in where:
        record = record[key]
    return record


def losses(result: RunResult, kind: str) -> dict[int, float]:
    """A run's training ("losses") or validation ("valid") losses by step."""
    return result.losses if kind == "losses" else result.valid_losses


@dataclass
class Reference:
    """One process's run in float32 (`result`, `record`: what a layout must match), in float64 (`exact_result`,
    `exact`), and every float32 draw ((result, record): the plain run and the reordered ones); the bounds that
    follow (module docstring)."""

    result: RunResult
    record: dict
    exact_result: RunResult
    exact: dict
    draws: list[tuple[RunResult, dict]]

    def error(self, where: tuple, name: str) -> float:
        """float32's own error in a tensor: the largest max|draw - fp64| over the draws."""
        exact = at(self.exact, where)[name]
        return max(float((at(record, where)[name].double() - exact).abs().max()) for _, record in self.draws)

    def bound(self, where: tuple, name: str) -> float:
        return K * self.error(where, name) + FLOOR_ULPS * EPS32 * float(at(self.exact, where)[name].abs().max())

    def noise_determined(self, where: tuple) -> list[str]:
        """The tensors at `where` whose bound exceeds SENSITIVE x their size."""
        return [n for n, t in at(self.exact, where).items() if self.bound(where, n) > SENSITIVE * float(t.abs().max())]

    def worst(self, record: dict, where: tuple, noise: tuple[str, ...] = ()) -> tuple[float, str]:
        """(the largest max|got_t - fp32_t| / bound_t over the tensors at `where` of another run's `record`, that
        tensor): <= 1 is within the bounds. First checks that the bounds can still see a real error: only tensors
        whose names end with one of `noise` may be noise-determined."""
        unexpected = [n for n in self.noise_determined(where) if not n.endswith(noise)]
        assert not unexpected, (where, "bounds above SENSITIVE x the tensor's size in", unexpected)
        got, want = at(record, where), at(self.record, where)
        assert sorted(got) == sorted(want)
        return max((float((got[n].double() - want[n].double()).abs().max()) / self.bound(where, n), n) for n in want)

    def loss_bound(self, kind: str, step: int) -> float:
        """The bound of a training ("losses") or validation ("valid") loss at `step`: K x float32's own error plus
        LOSS_FLOOR_ULPS ulps of the loss."""
        exact = losses(self.exact_result, kind)[step]
        error = max(abs(losses(result, kind)[step] - exact) for result, _ in self.draws)
        return K * error + LOSS_FLOOR_ULPS * EPS32 * abs(exact)

    def check_losses(self, got: dict[int, float], kind: str = "losses") -> None:
        """Another run's losses of `kind` by step, each within loss_bound of the float32 run's."""
        want = losses(self.result, kind)
        assert sorted(got) == sorted(want), (kind, sorted(got), sorted(want))
        for step in want:
            assert abs(got[step] - want[step]) <= self.loss_bound(kind, step), (kind, step, got[step], want[step])
