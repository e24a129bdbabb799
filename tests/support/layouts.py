"""The Megatron layouts the conversion tests write, under one naming scheme.

A layout's name is made from its fields, so two tests cannot call one layout by two names:

    tp2_ep2_etp1_pp2_vpp2_first1_last1_te_legacy_grouped
    │   │   │    │   │    │      │     │  └ expert layout, when not sequential
    │   │   │    │   │    │      │     └ Transformer Engine module names (else local)
    │   │   │    │   │    └──────┴ layers of the first / last pipeline stage, when uneven
    │   │   │    │   └ virtual pipeline stages per rank
    │   │   │    └ pipeline stages
    │   │   └ expert tensor parallel size, when not the tensor parallel size
    │   └ expert parallel size
    └ tensor parallel size (always named: tp1 is the single-file layout)

Sizes of 1 are left out of the name (but tp). FORMATS are Megatron's checkpoint formats; the distributed ones
(torch_dist, zarr, torch_dcp, fsdp_dtensor) do not depend on the pipeline or expert layout and take a tensor
parallel layout only, and legacy (Megatron-LM's pre-core checkpoints) has neither experts nor module specs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

RANK_FILE = "model_optim_rng.pt"  # in each rank folder of the torch and legacy formats
FORMATS = ("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor", "legacy")
DISTRIBUTED = ("torch_dist", "zarr", "torch_dcp", "fsdp_dtensor")
# a layout's sizes in the order its name gives them, with the saver option that sets each
_SIZES = (("tp", "--tp"), ("ep", "--ep"), ("etp", "--etp"), ("pp", "--pp"), ("vpp", "--vpp"),
          ("first", "--first-stage-layers"), ("last", "--last-stage-layers"))


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How a Megatron checkpoint is cut into rank files, and the names of its modules."""

    tp: int = 1
    ep: int = 1
    etp: int | None = None  # None: the tensor parallel size
    pp: int = 1
    vpp: int = 1
    first: int | None = None  # --first-stage-layers
    last: int | None = None  # --last-stage-layers
    impl: Literal["local", "te"] = "local"
    experts: Literal["sequential", "grouped", "legacy_grouped"] = "sequential"

    @property
    def name(self) -> str:
        return "_".join([f"{key}{value}" for key, _, value in self._sizes()] + self._spec())

    @property
    def args(self) -> list[str]:
        """The saver options that write this layout."""
        sizes = [arg for _, option, value in self._sizes() for arg in (option, str(value))]
        return sizes + ["--transformer-impl", "te"] * (self.impl == "te") + \
            ["--expert-layout", self.experts] * (self.experts != "sequential")

    def _sizes(self) -> list[tuple[str, str, int]]:
        """(name part, saver option, value) of each size other than its default; the tensor parallel size always."""
        return [(key, option, getattr(self, key)) for key, option in _SIZES
                if key == "tp" or getattr(self, key) != _DEFAULTS[key]]

    def _spec(self) -> list[str]:
        return ["te"] * (self.impl == "te") + [self.experts] * (self.experts != "sequential")

    @property
    def rank_dirs(self) -> list[str]:
        """The torch and legacy formats' rank folders, as Megatron names them: mp_rank_TT[_PPP][_EEE]."""
        return sorted(f"mp_rank_{t:02d}" + (f"_{p:03d}" if self.pp > 1 else "") + (f"_{e:03d}" if self.ep > 1 else "")
                      for t in range(self.tp) for p in range(self.pp) for e in range(self.ep))

    def saver_args(self, fmt: str) -> list[str]:
        """`--saver ...` writing this layout in Megatron format `fmt` (one of FORMATS)."""
        saver = ["--saver", "legacy"] if fmt == "legacy" else ["--saver", "core"]
        return saver + ["--ckpt-format", fmt] * (fmt in DISTRIBUTED) + self.args


_DEFAULTS = {f.name: f.default for f in fields(Layout)}
LAYOUTS = {layout.name: layout for layout in (
    # one file per rank, dense or not
    Layout(),
    Layout(tp=2),
    Layout(tp=4),
    Layout(pp=2),
    Layout(tp=2, pp=2),
    Layout(pp=3, first=1, last=1),
    Layout(pp=2, vpp=2),
    Layout(tp=2, pp=2, vpp=2),
    Layout(impl="te"),
    Layout(tp=2, impl="te"),
    Layout(tp=2, pp=2, impl="te"),
    Layout(tp=2, pp=2, vpp=2, impl="te"),
    # experts: EP, ETP, the expert layouts
    Layout(experts="legacy_grouped"),
    Layout(tp=2, impl="te", experts="grouped"),
    Layout(tp=2, ep=2),
    Layout(tp=2, ep=2, impl="te"),
    Layout(tp=2, ep=2, impl="te", experts="grouped"),
    Layout(tp=2, ep=2, pp=2),
    Layout(tp=2, ep=2, pp=2, impl="te"),
    Layout(tp=2, ep=2, pp=2, impl="te", experts="grouped"),
    Layout(tp=2, ep=2, pp=2, experts="legacy_grouped"),
    Layout(tp=2, ep=2, pp=2, vpp=2, impl="te"),
    Layout(tp=2, ep=2, pp=3, impl="te"),
    Layout(tp=2, ep=2, etp=1, pp=3),
    Layout(tp=2, etp=1, pp=2, experts="legacy_grouped"),
    Layout(tp=2, etp=1, pp=2, vpp=2, experts="legacy_grouped"),
    Layout(tp=2, ep=4, impl="te", experts="legacy_grouped"),
    Layout(tp=2, pp=2, first=1, experts="legacy_grouped"),
    Layout(ep=2, pp=2, last=1, impl="te"),
    Layout(ep=4, impl="te", experts="grouped"),
    Layout(ep=4, pp=2, first=1),
    Layout(ep=4, pp=2, first=1, impl="te"),
    Layout(ep=4, pp=2, impl="te", experts="grouped"),
    Layout(ep=4, pp=2, experts="legacy_grouped"),
)}


def rank_file(root: Path, name: str) -> Path:
    """Rank folder `name`'s file in the checkpoint at `root` (iteration 1, as mconvert writes)."""
    return root / "iter_0000001" / name / RANK_FILE

