"""The parallel layout of a run: sizes, the checks that refuse layouts the model cannot take, the device mesh.

    world = pp x dp x cp x tp            dp is what is left; expert parallel splits dp: dp = edp x ep

Ranks are laid out as Megatron lays them out: tensor parallel innermost (neighbouring ranks: the fastest links),
then context, then data (an expert-parallel group is ep neighbouring data-parallel ranks), pipeline outermost:

    mesh dims  ("pp", "edp", "ep", "cp", "tp"), flattened into
    "dp"     = edp x ep         the data-parallel ranks (different batches)
    "dp_cp"  = edp x ep x cp    ranks holding the same dense weights: FSDP shards over them
    "edp_cp" = edp x cp         ranks holding the same expert shard: expert gradients are summed over them

    world 8 = pp 2 x dp 2 x tp 2:   rank = 4 * pp + 2 * dp + tp
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mconvert.ir.config import ModelConfig
from mconvert.rules.layout import Chunk, LayoutError, ParallelLayout
from mtrain.config import ParallelConfig
from mtrain.errors import TrainError

MESH_DIMS = ("pp", "edp", "ep", "cp", "tp")
FLAT_DIMS = {"dp": ("edp", "ep"), "dp_cp": ("edp", "ep", "cp"), "edp_cp": ("edp", "cp")}


def config_field(option: str) -> str:
    """How mtrain's users name a layout option: the `parallel` section's field (mconvert says --tp)."""
    return f"parallel.{option}"


@dataclass(frozen=True)
class ParallelDims:
    world: int
    dp: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    schedule: str = "1F1B"
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @classmethod
    def from_config(cls, p: ParallelConfig, world: int) -> ParallelDims:
        model_ranks = p.tp * p.pp * p.cp
        if world % model_ranks:
            raise TrainError(f"parallel.tp {p.tp} x parallel.pp {p.pp} x parallel.cp {p.cp} = {model_ranks} does not "
                             f"divide the world size {world}; launch a multiple of {model_ranks} ranks")
        dp = world // model_ranks
        if dp % p.ep:
            raise TrainError(f"parallel.ep {p.ep} does not divide the data-parallel size {dp} (world {world} / "
                             f"(tp {p.tp} x pp {p.pp} x cp {p.cp})): expert-parallel ranks are data-parallel ranks")
        return cls(world=world, dp=dp, tp=p.tp, pp=p.pp, vpp=p.vpp, cp=p.cp, ep=p.ep,
                   sequence_parallel=p.sequence_parallel, schedule=p.schedule,
                   first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers)

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    @property
    def layout(self) -> ParallelLayout:
        """mconvert's layout: the same layer assignment to (virtual) pipeline stages as Megatron checkpoints."""
        return ParallelLayout(tp=self.tp, pp=self.pp, vpp=self.vpp, ep=self.ep,
                              first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers)

    def chunks(self, num_layers: int) -> list[Chunk]:
        try:
            return self.layout.chunks(num_layers)
        except LayoutError as e:
            raise TrainError(e.spelled(config_field)) from None

    def check_model(self, c: ModelConfig) -> None:
        """Refuse a model this layout cannot split, naming the size that does not divide (all problems at once)."""
        problems = [LayoutError(p).spelled(config_field) for p in self.layout.model_problems(c)]
        if c.attention_sinks and self.cp > 1:  # the sink's share needs every key's score (model.sink_attention)
            problems.append(f"parallel.cp {self.cp} with attention sinks (model.attention_sinks), which context "
                            "parallel's attention does not compute: use parallel.cp 1")
        if problems:
            raise TrainError("the parallel layout does not fit the model: " + "; ".join(problems))
        self.chunks(c.num_layers)

    def check_batches(self, seq_len: int, global_batch: int, micro_batch: int) -> None:
        """Sequence length and micro-batch counts the layout needs."""
        if global_batch % (micro_batch * self.dp):
            raise TrainError(f"train.global_batch_size {global_batch} is not a multiple of train.micro_batch_size "
                             f"{micro_batch} x {self.dp} data-parallel ranks")
        micro_batches = global_batch // (micro_batch * self.dp)
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise TrainError(f"data.seq_len {seq_len} is not divisible by 2 x parallel.cp = {2 * self.cp}: each "
                             "context-parallel rank takes two equal chunks of every sequence")
        local = seq_len // self.cp
        if self.sequence_parallel and local % self.tp:
            raise TrainError(f"data.seq_len {seq_len} / parallel.cp {self.cp} = {local} tokens per rank is not "
                             f"divisible by parallel.tp {self.tp}, as sequence parallel needs")
        if self.pp > 1 and self.schedule in ("1F1B", "GPipe") and micro_batches < self.pp:
            raise TrainError(f"parallel.pp {self.pp} with the {self.schedule} schedule needs at least {self.pp} "
                             f"micro-batches per step; train.global_batch_size / (train.micro_batch_size x "
                             f"{self.dp} data-parallel ranks) gives {micro_batches}")
        if self.pp > 1 and self.vpp > 1:
            rounds = max(1, micro_batches // self.pp)
            if micro_batches % rounds:
                raise TrainError(f"the {self.schedule} schedule needs the micro-batches per step ({micro_batches}) "
                                 f"to be a multiple of {rounds} (rounds of parallel.pp {self.pp}); use a multiple "
                                 f"of {self.pp}")

    def build_mesh(self, device_type: str) -> Mesh | None:
        """The device mesh with the flattened dims of the module docstring (None for one process)."""
        if self.world == 1:
            return None
        sizes = (self.pp, self.edp, self.ep, self.cp, self.tp)
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)
        return Mesh(mesh, {name: mesh[dims]._flatten(name) for name, dims in FLAT_DIMS.items()})

    def describe(self) -> str:
        parts = [f"DP{self.dp}"]
        for name in ("tp", "pp", "vpp", "ep", "cp"):
            if getattr(self, name) > 1:
                parts.append(f"{name.upper()}{getattr(self, name)}")
        if self.sequence_parallel:
            parts.append("SP")
        if self.pp > 1:
            parts.append(f"({self.schedule})")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Coords:
    """This rank's position on each mesh dimension."""

    pp: int = 0
    dp: int = 0
    cp: int = 0
    tp: int = 0
    ep: int = 0

    @classmethod
    def of(cls, mesh: Mesh | None) -> Coords:
        if mesh is None:
            return cls()
        return cls(**{name: mesh[name].get_local_rank() for name in ("pp", "dp", "cp", "tp", "ep")})


class Mesh:
    """The run's device mesh: `mesh["tp"]`, `mesh["ep", "tp"]` slice the root mesh, `mesh["dp_cp"]` (a FLAT_DIMS
    name) is the mesh `_flatten` made. PyTorch deprecates slicing a flattened dim from the root (a UserWarning on
    every rank), so the flattened meshes are kept here."""

    def __init__(self, root: DeviceMesh, flat: dict[str, DeviceMesh]):
        self.root, self.flat = root, flat

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str) and names in self.flat:
            return self.flat[names]
        return self.root[names]

    def __getattr__(self, name: str):  # the rest (e.g. `.mesh`, the rank tensor) is the root mesh's
        return getattr(self.root, name)


def group(mesh: Mesh | None, name: str) -> dist.ProcessGroup | None:
    """The process group of one mesh dimension, None when it has a single rank."""
    if mesh is None or mesh[name].size() == 1:
        return None
    return mesh[name].get_group()

