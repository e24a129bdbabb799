"""Run two checkpoints side by side on the same tokens and judge whether they are the same model.

    A ─ loader ─ IR ─┐                 stage by stage, for "embed", "layer 0" … "layer L-1", "logits":
                     ├─ streams ──▶   build the stage of each stream from its IR, run it on its hidden
    B ─ loader ─ IR ─┘                 states, free it; compare A's output with B's

Streams: "A" and "B" (mtrain's model on each IR, or transformers for the Hugging Face side with `--reference`);
with casts also "R", the cast reference (tolerance.py), compared with the cast's source side ("H", mtrain's run
of that side, when transformers runs it; "S", the source model, when the casts went both ways) to measure the
cast noise. The stages after "logits" are the MTP
modules' logits ("mtp 0", ...), judged as the logits are. Each stage's tensors are also compared whole, pair by
pair, after it runs (tensors.py), which judges what the tokens never reach. The verdict: the logits and every
stage within their bounds, every tensor equal (to its reference rounding, in a cast), and no config field that
changes the outputs differing (fields.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from mconvert import engine
from mconvert.errors import ConvertError
from mconvert.ir.tensors import ModelIR
from mconvert.options import Options
from mconvert.progress import QUIET, Progress
from mconvert.tools.verify.fields import FieldDiff, config_differences
from mconvert.tools.verify.metrics import LogitMetrics, hidden_metrics, logit_metrics
from mconvert.tools.verify.reference import is_hf_dir, run_transformers
from mconvert.tools.verify.stages import (
    StageOutput,
    is_logits,
    run_stages,
    stage_names,
    table_inputs,
)
from mconvert.tools.verify.tensors import TensorCheck, TensorDiff, stage_differences
from mconvert.tools.verify.tolerance import Bound, Kind, cast_reference, logit_bound, stage_bound


@dataclass(frozen=True, kw_only=True)
class VerifySettings:
    tokens: int = 256  # random tokens in all, in sequences of seq_len
    seq_len: int = 128
    seed: int = 0
    prompt: str | None = None  # text to tokenize with a checkpoint's tokenizer instead of random tokens
    device: str = "cpu"
    reference: Literal["transformers"] | None = None
    loader_a: str | None = None
    loader_b: str | None = None
    options: Options = field(default_factory=Options)  # for the loaders (true_vocab_size)


@dataclass(frozen=True)
class Side:
    path: str
    format: str
    dtype: str  # the tensors' dtypes, e.g. "float32" or "bfloat16+float32"
    runner: str  # "mtrain" or "transformers"


@dataclass(frozen=True)
class StageResult:
    name: str
    max_abs: float
    rel: float | None  # ||Δ|| / ||A|| for hidden states; None for the logits
    bound: float
    diverged: bool  # beyond the bound (for the logits: max |Δ|, mean KL or the vocabulary)
    read_seconds: float  # reading this stage's weights into its module, all streams
    run_seconds: float  # running it, all streams

    @property
    def seconds(self) -> float:
        return self.read_seconds + self.run_seconds


@dataclass(frozen=True)
class Report:
    a: Side
    b: Side
    tokens: tuple[int, int]  # (sequences, length)
    source: str  # "random (seed 0)" or "prompt"
    logits: LogitMetrics
    noise: LogitMetrics | None  # the cast reference's distance (casts only)
    bound: Bound
    config: list[FieldDiff]
    stages: list[StageResult]
    stage_tensors: list[str]  # tensors of the first diverging stage that differ (after rounding to one dtype)
    tensors: list[TensorDiff]  # every tensor that differs (after rounding to one dtype), whatever its stage
    skipped: list[str]  # stages that were not compared, and why
    warnings: list[str]  # what the tokens cannot exercise
    seconds: float

    @property
    def first_field(self) -> FieldDiff | None:
        """The first config field that differs and changes the outputs."""
        return next((d for d in self.config if d.changes_outputs), None)

    @property
    def first_stage(self) -> str | None:
        return next((s.name for s in self.stages if s.diverged), None)

    @property
    def passed(self) -> bool:
        return (self.bound.admits(self.logits) and self.first_field is None and self.first_stage is None
                and not self.tensors)


@dataclass(frozen=True)
class Plan:
    """The streams to run and how to judge them."""

    irs: dict[str, ModelIR]  # stream -> its checkpoint: "A", "B", with casts "R" (and "H" or "S")
    runners: dict[str, Literal["mtrain", "transformers"]]
    noise_pair: tuple[str, str] | None  # the streams whose distance is the cast noise, oriented as (A, B)
    kind: Kind


def plan(ir_a: ModelIR, ir_b: ModelIR, reference: Literal["A", "B"] | None) -> Plan:
    irs = {"A": ir_a, "B": ir_b}
    runners = {k: "transformers" if reference == k else "mtrain" for k in irs}
    cast = cast_reference(ir_a, ir_b)
    if not cast:
        return Plan(irs, runners, None, "reference" if reference else "exact")
    side, source, rounded = cast
    irs["R"], runners["R"] = rounded, "mtrain"
    if side == "mixed":  # the source model is neither side: run it too
        s, irs["S"], runners["S"] = "S", source, "mtrain"
    else:
        s = side if runners[side] == "mtrain" else "H"  # the noise is mtrain's, on both of its sides
        if s == "H":
            irs["H"], runners["H"] = source, "mtrain"
    return Plan(irs, runners, ("R", s) if side == "B" else (s, "R"), "reference" if reference else "cast")


def verify(a: Path, b: Path, settings: VerifySettings = VerifySettings(), progress: Progress = QUIET,
           labels: tuple[str, str] | None = None) -> Report:
    """Compare the checkpoints at `a` and `b` (any formats) by running both; `labels` name them in the report."""
    start = time.perf_counter()
    ir_a = engine.load(Path(a), settings.options, settings.loader_a)
    ir_b = engine.load(Path(b), settings.options, settings.loader_b)
    for label, ir in (("A", ir_a), ("B", ir_b)):
        if ir.config.is_bert:  # mtrain's GPT model would run it causally, without its token types and MLM head
            raise ConvertError(f"{label}: a BERT encoder ({ir.config.family}); verify runs decoder-only (GPT) models "
                               "and would compute another architecture; compare its tensors with `mconvert compare`")
    device = parse_device(settings.device)
    tokens, source = make_tokens(settings, ir_a, ir_b)
    p = plan(ir_a, ir_b, reference_side(settings, a, b, ir_a, ir_b))
    paths = {"A": Path(a), "B": Path(b)}
    total = sum(p.irs[k].nbytes for k, run in p.runners.items() if run == "mtrain")
    stages: list[StageResult] = []
    checked = TensorCheck(ir_a, ir_b)
    left: dict[str, set[str]] = {}
    tables = table_inputs(ir_a.config, ir_b.config)
    count = len(tables) + len(stage_names(ir_a.config.num_layers, ir_a.config.mtp_layers))
    with progress.task(f"verify: {count} stages x {len(p.irs)} models", total) as advance:
        streams = {k: run_transformers(paths[k], tokens, ir.config.num_layers, device, tables)
                   if p.runners[k] == "transformers" else run_stages(ir, tokens, device, advance, tables)
                   for k, ir in p.irs.items()}
        for name, out in lockstep(streams, left):
            if is_logits(name):
                metrics, noise_of, bound_of = judge_logits(out, p)
                if name == "logits":
                    logits, noise, bound = metrics, noise_of, bound_of
                stages.append(StageResult(name, metrics.max_abs, None, bound_of.max_abs, not bound_of.admits(metrics),
                                          *_seconds(out)))
            else:
                stages.append(judge_hidden(name, out, p))
            checked.stage(name)
    tensors = checked.rest()
    first = next((s.name for s in stages if s.diverged), None)
    names = labels or (str(a), str(b))
    return Report(
        a=Side(names[0], ir_a.source.format, dtypes(ir_a), p.runners["A"]),
        b=Side(names[1], ir_b.source.format, dtypes(ir_b), p.runners["B"]),
        tokens=(tokens.shape[0], tokens.shape[1]), source=source, logits=logits, noise=noise, bound=bound,
        config=config_differences(ir_a.config, ir_b.config), stages=stages,
        stage_tensors=stage_differences(tensors, ir_a, ir_b, first) if first else [], tensors=tensors,
        skipped=skipped_stages(ir_a, ir_b, stages, left, p), warnings=token_warnings(tokens),
        seconds=time.perf_counter() - start)


def skipped_stages(a: ModelIR, b: ModelIR, stages: list[StageResult], left: dict[str, set[str]], p: Plan
                   ) -> list[str]:
    """Each stage of either model that was not compared, and why (said plainly: its tensors are still compared)."""
    judged = {s.name for s in stages}
    expected = dict.fromkeys(stage_names(a.config.num_layers, a.config.mtp_layers)
                             + stage_names(b.config.num_layers, b.config.mtp_layers))
    out = []
    for name in (n for n in expected if n not in judged):
        ran = sorted(k for k in left.get(name, ()) if k in ("A", "B"))
        missing = [k for k in ("A", "B") if k not in ran]
        if name.startswith("mtp ") and any(p.runners[k] == "transformers" for k in missing):
            why = "transformers does not run MTP modules"
        elif ran:
            why = f"only {' and '.join(ran)} {'has' if len(ran) == 1 else 'have'} it"
        else:
            why = "the sequences are too short for it"
        out.append(f"{name}: not run on both sides ({why}); its tensors are compared one by one")
    return out


def token_warnings(tokens: torch.Tensor) -> list[str]:
    if tokens.shape[1] > 1:
        return []
    return ["sequences of one token exercise neither attention between tokens nor rotary or learned positions "
            "beyond the first: pass a longer --prompt, or --seq-len 2 or more"]


def judge_logits(out: dict[str, StageOutput], p: Plan) -> tuple[LogitMetrics, LogitMetrics | None, Bound]:
    logits = logit_metrics(out["A"].value, out["B"].value)
    noise = logit_metrics(out[p.noise_pair[0]].value, out[p.noise_pair[1]].value) if p.noise_pair else None
    return logits, noise, logit_bound(p.kind, noise, logits.scale)


def judge_hidden(name: str, out: dict[str, StageOutput], p: Plan) -> StageResult:
    main = hidden_metrics(out["A"].value, out["B"].value)
    noise = hidden_metrics(out[p.noise_pair[0]].value, out[p.noise_pair[1]].value) if p.noise_pair else None
    limit = stage_bound(p.kind, noise, main.scale)
    return StageResult(name, main.max_abs, main.rel, limit, not main.max_abs <= limit, *_seconds(out))


def _seconds(out: dict[str, StageOutput]) -> tuple[float, float]:
    return sum(o.read_seconds for o in out.values()), sum(o.run_seconds for o in out.values())


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConvertError(f"--device {name!r} is not a device; expected cpu, cuda, cuda:1, ...") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConvertError(f"--device {name}: CUDA is not available here; use --device cpu")
    return device


def lockstep(streams: dict[str, Iterator[StageOutput]], left: dict[str, set[str]] | None = None
             ) -> Iterator[tuple[str, dict[str, StageOutput]]]:
    """Advance every stream one stage at a time; yield each stage once every stream has produced it.

    Streams of models with different layer counts share "embed", their common layers and "logits"; the outputs
    of the extra layers are dropped once every stream is done (`left`, when given, gets the streams that
    produced each stage not yielded).
    """
    pending: dict[str, dict[str, StageOutput]] = {}
    active = dict(streams)
    while active:
        for key, stream in list(active.items()):
            out = next(stream, None)
            if out is None:
                del active[key]
                continue
            got = pending.setdefault(out.name, {})
            got[key] = out
            if len(got) == len(streams):
                yield out.name, pending.pop(out.name)
    if left is not None:
        left.update({name: set(got) for name, got in pending.items()})


def make_tokens(settings: VerifySettings, a: ModelIR, b: ModelIR) -> tuple[torch.Tensor, str]:
    """The (B, T) tokens both models run on: the prompt's, or random ones from the vocabulary both share."""
    vocab = min(a.config.vocab_size, b.config.vocab_size)
    if settings.prompt is not None:
        ids = _encode(settings.prompt, a, b)
        if max(ids) >= vocab:
            raise ConvertError(f"the prompt's token id {max(ids)} is outside the vocabulary of {vocab} tokens")
        tokens, source = torch.tensor([ids]), f"prompt ({len(ids)} tokens)"
    else:
        if settings.tokens < 1 or settings.seq_len < 1:
            raise ConvertError(f"--tokens and --seq-len must be positive, got {settings.tokens}, {settings.seq_len}")
        length = min(settings.seq_len, settings.tokens)
        g = torch.Generator().manual_seed(settings.seed)
        tokens = torch.randint(0, vocab, (settings.tokens // length, length), generator=g)
        source = f"random (seed {settings.seed})"
    for side, ir in (("A", a), ("B", b)):
        c = ir.config
        if c.position_embedding == "learned" and tokens.shape[1] > c.max_position_embeddings:
            raise ConvertError(f"sequences of {tokens.shape[1]} tokens exceed {side}'s {c.max_position_embeddings} "
                               f"learned positions; pass --seq-len {c.max_position_embeddings} or less")
    return tokens, source


def _encode(prompt: str, a: ModelIR, b: ModelIR) -> list[int]:
    from mtrain.data.tokenizer import checkpoint_tokenizer, load_tokenizer

    path = checkpoint_tokenizer(a.assets) or checkpoint_tokenizer(b.assets)
    if path is None:
        raise ConvertError(f"--prompt needs a tokenizer, and neither {a.source.path} nor {b.source.path} carries "
                           "tokenizer files; use random tokens (--tokens, --seq-len, --seed)")
    ids = load_tokenizer(path).encode(prompt)
    if not ids:
        raise ConvertError(f"the prompt {prompt!r} encodes to no tokens")
    return ids


def reference_side(settings: VerifySettings, a: Path, b: Path, ir_a: ModelIR, ir_b: ModelIR
                   ) -> Literal["A", "B"] | None:
    """Which side transformers runs: A if it is a Hugging Face directory, else B."""
    if settings.reference is None:
        return None
    if settings.reference != "transformers":
        raise ConvertError(f"--reference {settings.reference!r}: the only reference is 'transformers'")
    for side, path in (("A", a), ("B", b)):
        if is_hf_dir(Path(path)):
            return side
    raise ConvertError(f"--reference transformers runs a Hugging Face directory (with config.json) with transformers, "
                       f"and neither {a} ({ir_a.source.format}) nor {b} ({ir_b.source.format}) is one")


def dtypes(ir: ModelIR) -> str:
    return "+".join(sorted({str(t.dtype).removeprefix("torch.") for t in ir.tensors.values()}))
