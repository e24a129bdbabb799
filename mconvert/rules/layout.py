"""Parallel layouts: which layers live in which pipeline stage and virtual chunk, and which ranks exist.

Pipeline assignment follows Megatron-core: stages get `num_layers / pp` layers each, except that the first
and/or last stage may be given their own count (`--first-stage-layers`, `--last-stage-layers`), the rest being
split evenly over the middle stages. With virtual pipelining every stage's layers are split into `vpp` equal
chunks, and chunks are ordered chunk-major: chunk v of stage p starts after all of chunk v-1 on every stage and
after chunk v of stages 0..p-1, i.e. at `v*L/V + p*L/(P*V)` when stages are even.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mconvert.errors import ConvertError
from mconvert.ir.config import ModelConfig


def flag(name: str) -> str:
    """mconvert's spelling of a layout option: `tp` -> `--tp`, `first_stage_layers` -> `--first-stage-layers`."""
    return "/".join("--" + n.replace("_", "-") for n in name.split("/"))


class _Spelling(dict):
    def __init__(self, spell: Callable[[str], str]) -> None:
        super().__init__()
        self.spell = spell

    def __missing__(self, name: str) -> str:
        return self.spell(name)


class LayoutError(ConvertError):
    """A layout the model cannot take. Its template names layout options as `{tp}`, `{vpp}`, ... (`{a/b}` for
    two at once): the message spells them as mconvert's flags, and every other front end spells them its own
    way with `spelled` (mtrain: `parallel.tp`), so the checks exist once."""

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__(self.spelled(flag))

    def spelled(self, spell: Callable[[str], str]) -> str:
        return self.template.format_map(_Spelling(spell))


@dataclass(frozen=True)
class Chunk:
    """One model chunk in one file: pipeline stage `pp`, virtual index `vpp`, its global layers."""

    pp: int
    vpp: int
    layers: range
    has_embedding: bool
    has_head: bool


def chunks_of(sizes: dict[tuple[int, int], int], pp: int, vpp: int) -> list[Chunk]:
    """The chunks holding `sizes[(stage, virtual chunk)]` layers each, layers numbered chunk-major (all stages'
    chunk v before any chunk v+1), listed stage-major. The first chunk embeds, the last one holds the head."""
    starts, next_layer = {}, 0
    for v in range(vpp):
        for p in range(pp):
            starts[(p, v)], next_layer = next_layer, next_layer + sizes[(p, v)]
    return [Chunk(p, v, range(starts[(p, v)], starts[(p, v)] + sizes[(p, v)]), has_embedding=(p, v) == (0, 0),
                  has_head=(p, v) == (pp - 1, vpp - 1)) for p in range(pp) for v in range(vpp)]


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel size; None: the same as tp
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "ep", "etp"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise LayoutError(f"{{{name}}} must be at least 1, got {getattr(self, name)}")
        if self.tp % self.expert_tp:
            # A Megatron rank's expert-TP rank is its TP rank modulo etp only when etp divides tp.
            raise LayoutError(f"{{etp}} {self.etp} must divide {{tp}} {self.tp}")
        if self.pp == 1 and self.vpp > 1:
            raise LayoutError(f"{{vpp}} {self.vpp} needs {{pp}} > 1: virtual pipeline chunks interleave pipeline "
                               "stages (Megatron refuses virtual pipelining without pipeline parallelism)")
        if self.pp == 1 and (self.first_stage_layers or self.last_stage_layers):
            raise LayoutError("{first_stage_layers/last_stage_layers} need {pp} > 1")

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size: Megatron's expert_tensor_parallel_size, by default the TP size."""
        return self.tp if self.etp is None else self.etp

    def stage_sizes(self, num_layers: int) -> list[int]:
        """Number of layers on each pipeline stage."""
        p, first, last = self.pp, self.first_stage_layers, self.last_stage_layers
        if p == 1:
            return [num_layers]
        fixed = {0: first} if first is not None else {}
        if last is not None:
            fixed[p - 1] = last
        rest = num_layers - sum(fixed.values())
        middle = p - len(fixed)
        if rest < 0 or (middle == 0 and rest != 0) or (middle and rest % middle):
            raise LayoutError(
                f"cannot place {num_layers} layers on {p} pipeline stages"
                + (f" with {first} on the first" if first is not None else "")
                + (f" and {last} on the last" if last is not None else "")
                + (f": the remaining {rest} layers do not split evenly over {middle} stages" if middle else "")
                + "; choose {pp} dividing the layers or set {first_stage_layers/last_stage_layers}"
            )
        return [fixed.get(i, rest // middle if middle else 0) for i in range(p)]

    def chunks(self, num_layers: int) -> list[Chunk]:
        """Every (stage, virtual chunk) with its global layer range, in stage-major order."""
        sizes = self.stage_sizes(num_layers)
        bad = [s for s in sizes if s % self.vpp]
        if bad:
            raise LayoutError(f"{{vpp}} {self.vpp} must divide the layers of every pipeline stage {sizes}")
        return chunks_of({(p, v): sizes[p] // self.vpp for p in range(self.pp) for v in range(self.vpp)},
                         self.pp, self.vpp)

    def check_model(self, c: ModelConfig) -> None:
        """Refuse layouts the model cannot take, naming every size that does not divide, then the stages."""
        problems = self.model_problems(c)
        if problems:
            raise LayoutError("; ".join(problems))
        self.chunks(c.num_layers)

    def model_problems(self, c: ModelConfig) -> list[str]:
        """The sizes of the model this layout cannot split, as LayoutError templates."""
        problems = []
        # MoE experts are split over the expert TP size, which may be smaller than TP; dense MLPs over TP
        expert_option = "etp" if self.etp is not None else "tp"
        sizes = [("tp", self.tp, "num_attention_heads", c.num_attention_heads),
                 ("tp", self.tp, "num_query_groups (key/value heads)", c.num_query_groups)]
        if c.is_moe:
            sizes.append((expert_option, self.expert_tp, "ffn_hidden_size" if c.moe_ffn_hidden_size is None
                          else "moe_ffn_hidden_size", c.expert_ffn_hidden_size))
        if not c.is_moe or c.dense_layers:
            sizes.append(("tp", self.tp, "ffn_hidden_size", c.ffn_hidden_size))
        for option, split, what, value in sizes:
            if value % split:
                problems.append(f"{{{option}}} {split} does not divide {what}={value}")
        if c.is_moe and c.num_experts % self.ep:
            problems.append(f"{{ep}} {self.ep} does not divide num_experts={c.num_experts}")
        if not c.is_moe and self.ep > 1:
            problems.append(f"{{ep}} {self.ep} needs a mixture-of-experts model; this one is dense")
        if not c.is_moe and self.expert_tp != self.tp:
            problems.append(f"{{etp}} {self.etp} needs a mixture-of-experts model; this one is dense")
        return problems

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.expert_tp != self.tp:
            parts.append(f"ETP{self.expert_tp}")
        return " ".join(parts)
