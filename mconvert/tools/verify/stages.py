"""Run a checkpoint through mtrain's model one stage at a time, holding one layer's weights at once.

    stage     "embed"          "layer 0" … "layer L-1"       "logits"                    "mtp 0" … "mtp M-1"
    module    Transformer(     Transformer(                  Transformer(                (the same module:
                layers=[],       layers=[L],                   layers=[], last=True)       embedding, MTP
                first=True)      first=False)                  final norm, head            modules, head)
    output    (B, T, h)        (B, T, h)                     (B, T, V)                   (B, T-1-m, V)

Before them, the "table" stages run the first stage's embedding path (token embedding plus learned positions)
on every token id of the vocabulary, in sequences as long as the learned positions, so every row of the embedding
and position tables is judged through the model's own embedding, not only the rows the test tokens reach
(`table_inputs`; up to 256 MB of output per stage, each stage built and freed like the others).

The MTP modules (DeepSeek-V3's multi-token prediction) run as the model runs them in training (mtrain's
`Transformer.mtp_logits`): module m reads the previous module's hidden states (the model's, after its final
norm, for m = 0) and the embedding of the tokens m+1 further on; its logits at positions 0..T-2-m predict the
tokens m+2 further on.

Each stage is an mtrain pipeline stage built from the IR config on the meta device, given its weights from
the IR's lazy tensors (read now, not before) and freed before the next stage is built, so the peak memory is
one layer whatever the model size. Because the stages are mtrain's own `Transformer` (the same code that
trains and generates), a family added to mtrain's model is verified without any change here. Weights are
upcast to fp32: the computation is fp32 whatever the checkpoint's dtype.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from mconvert.errors import ConvertError
from mconvert.ir.config import ModelConfig
from mconvert.ir.names import embedding_shapes, head_shapes, layer_shapes, mtp_shapes
from mconvert.ir.tensors import ModelIR
from mtrain import weights
from mtrain.errors import TrainError
from mtrain.models import mtp
from mtrain.models.model import Transformer


@dataclass(frozen=True)
class StageOutput:
    name: str
    value: torch.Tensor  # hidden states (B, T, h), or logits (B, T, V) for the last stage
    read_seconds: float  # reading the stage's weights into its module
    run_seconds: float  # the forward pass of the stage


def stage_names(num_layers: int, mtp_layers: int = 0) -> list[str]:
    return ["embed", *(f"layer {i}" for i in range(num_layers)), "logits", *(f"mtp {m}" for m in range(mtp_layers))]


# Values per "table" stage output, (ids, h) in fp32 per model: 256 MB, less than one layer of a 7B model in fp32.
# Each table stage builds the embedding again, so fewer, larger stages are faster (32k ids at hidden 2048).
TABLE_VALUES = 1 << 26
_ROPE_TABLE_LENGTH = 256  # sequence length of the table stages without learned positions (no attention runs)


def table_inputs(a: ModelConfig, b: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """("table FIRST-LAST", tokens (n, T)) covering every token id both vocabularies have, in sequences as long
    as the shorter learned position table (every position row is then added to a token too; the ids wrap)."""
    vocab = min(a.vocab_size, b.vocab_size)
    learned = [c.max_position_embeddings for c in (a, b) if c.position_embedding == "learned"]
    # rotary models: no longer than either accepts (transformers' dynamic rope types rescale beyond it)
    length = min(learned) if learned else min(_ROPE_TABLE_LENGTH, vocab, a.max_position_embeddings,
                                              b.max_position_embeddings)
    per = max(1, TABLE_VALUES // max(a.hidden_size, b.hidden_size) // length)  # sequences per stage
    total = -(-vocab // length)  # sequences that cover every id
    out = []
    for first in range(0, total, per):
        n = min(per, total - first)
        ids = torch.arange(first * length, (first + n) * length) % vocab
        out.append((f"table {first * length}-{min((first + n) * length, vocab) - 1}", ids.view(n, length)))
    return out


def is_logits(stage: str) -> bool:
    """Does the stage output logits (the model's or an MTP module's) rather than hidden states?"""
    return stage == "logits" or stage.startswith("mtp ")


def stage_tensors(c: ModelConfig, stage: str) -> list[str]:
    """The IR tensors a stage reads."""
    if stage == "embed" or stage.startswith("table "):
        return list(embedding_shapes(c))
    if stage == "logits":
        return list(head_shapes(c)) + (["embed.weight"] if c.tie_embeddings else [])
    if stage.startswith("mtp "):
        return list(mtp_shapes(int(stage.removeprefix("mtp ")), c))
    return list(layer_shapes(int(stage.removeprefix("layer ")), c))


def run_stages(ir: ModelIR, tokens: torch.Tensor, device: torch.device,
               on_read: Callable[[int], None] = lambda n: None,
               tables: list[tuple[str, torch.Tensor]] = ()) -> Iterator[StageOutput]:
    """The output of every stage of `ir`'s model on `tokens` (B, T), in order, after the embedding path's output
    on each of the `tables` (table_inputs); `on_read(bytes)` after each read (of the model's stages)."""
    c = ir.config
    for name, ids in tables:
        start = time.perf_counter()
        stage = _build(ir, dict(layers=[], first=True, last=False), device)
        loaded = time.perf_counter()
        with torch.no_grad():
            h = stage(ids.to(device))
        del stage
        yield StageOutput(name, h, loaded - start, time.perf_counter() - loaded)
    specs = [dict(layers=[], first=True, last=False),
             *(dict(layers=[i], first=False, last=False) for i in range(c.num_layers)),
             dict(layers=[], first=False, last=True)]
    tokens = tokens.to(device)
    h = tokens
    for name, spec in zip(stage_names(c.num_layers), specs):
        start = time.perf_counter()
        try:
            stage = _build(ir, spec, device)
        except TrainError as e:
            raise ConvertError(f"{ir.source.path}: mtrain cannot run this model: {e}") from None
        read = stage_tensors(c, name) + [n for m in range(c.mtp_layers if spec["last"] else 0)
                                         for n in stage_tensors(c, f"mtp {m}")]
        on_read(sum(ir[n].nbytes for n in read))
        loaded = time.perf_counter()
        with torch.no_grad():
            outputs = _mtp_outputs(stage, h, tokens) if spec["last"] else []
            h = stage(h)
        del stage  # free this stage's weights before the next stage is built
        yield StageOutput(name, h, loaded - start, time.perf_counter() - loaded)
        yield from outputs


def _mtp_outputs(stage: Transformer, h: torch.Tensor, tokens: torch.Tensor) -> list[StageOutput]:
    """The logits of each MTP module of the last stage, from the hidden states `h` (B, T, h) of the last layer."""
    if stage.mtp is None:
        return []
    T = tokens.shape[1]
    positions = torch.arange(T, device=tokens.device)
    following = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)  # the labels, but for the unknown last one
    out, start = [], time.perf_counter()
    for m, (hidden, _) in enumerate(mtp.hidden_states(stage, stage.final_norm(h), following, positions,
                                                      stage.context(positions))):
        if T - 1 - m < 1:
            break  # no position has a token m+2 further on (verify says so: a stage not run)
        logits = stage.head(hidden[:, :T - 1 - m])
        out.append(StageOutput(f"mtp {m}", logits, 0.0, time.perf_counter() - start))
        start = time.perf_counter()
    return out


def _build(ir: ModelIR, spec: dict, device: torch.device) -> Transformer:
    with torch.device("meta"):
        stage = Transformer(ir.config, **spec)
    stage.to_empty(device=device)  # the buffers; parameters are replaced by the tensors read below
    stage.init_buffers()
    # Assigned, not copied: one pass over each tensor (the fp32 cast), none for fp32 tensors already in memory.
    state = {name: t.to(device=device, dtype=torch.float32)
             for name, t in weights.ir_weights(ir, weights.local_names(stage))}
    stage.load_state_dict(state, strict=True, assign=True)
    return stage.eval()
