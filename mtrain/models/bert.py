"""BERT (Megatron's pre-LN encoder) with its masked-LM head and the optional next-sentence-prediction head.

    inputs (B, 3, T): tokens, token types, padding mask (1 = a real token)
    h = embed(tokens) + pos_embed(positions) + token_type_embed(types)
    layers["0"] … layers["L-1"]: the decoder's pre-norm Blocks, attention bidirectional (padding keys masked)
    h = final_norm(h)
    MLM logits (B, T, V) = linear(layernorm(gelu(dense(h))), embed.weight) + bias     (the decoder tied, as Megatron)
    NSP logits (B, 2)    = nsp_head(tanh(pooler(h[:, 0])))                          (with the binary head only)

The layers, embeddings and final norm are the Transformer's (norm layernorm, activation gelu, learned positions,
biases on, tied embeddings). The BERT-only tensors are named, until the IR has BERT names, by BERT_TENSORS below
(mtrain's own placeholders); `BertSpec` holds what the IR config does not yet say (token types, binary head).

Loss (Megatron's pretrain_bert): the mean cross entropy over the predicted (masked) positions of a micro-batch,
plus, with the binary head, the mean NSP cross entropy over its samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from mconvert.ir.config import ModelConfig
from mtrain.data.bert_dataset import IGNORE
from mtrain.errors import TrainError
from mtrain.models.model import LayerContext, Transformer, make_norm


@dataclass(frozen=True)
class BertSpec:
    """What a BERT model has beyond the IR config: token types (0: none) and the binary (NSP) head."""

    num_tokentypes: int = 2
    binary_head: bool = True


def bert_tensors(c: ModelConfig, spec: BertSpec) -> dict[str, tuple[int, ...]]:
    """The BERT-only parameters (placeholder names) and their full shapes."""
    h = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    if spec.num_tokentypes:
        shapes["token_type_embed.weight"] = (spec.num_tokentypes, h)
    shapes |= {"mlm_head.dense.weight": (h, h), "mlm_head.dense.bias": (h,), "mlm_head.norm.weight": (h,),
               "mlm_head.norm.bias": (h,), "mlm_head.bias": (c.vocab_size,)}
    if spec.binary_head:
        shapes |= {"pooler.weight": (h, h), "pooler.bias": (h,), "nsp_head.weight": (2, h), "nsp_head.bias": (2,)}
    return shapes


def check_config(c: ModelConfig) -> None:
    """BERT's architecture in IR terms: anything else is refused by name."""
    wanted = {"position_embedding": "learned", "norm": "layernorm", "tie_embeddings": True, "num_experts": None,
              "mtp_layers": 0, "sliding_window": None}
    wrong = [f"model.{k} is {getattr(c, k)!r} (BERT needs {v!r})" for k, v in wanted.items() if getattr(c, k) != v]
    if wrong:
        raise TrainError("a BERT model (mlm.enabled): " + "; ".join(wrong))


class MLMHead(nn.Module):
    """dense -> gelu -> layernorm; the output layer is the word embedding plus this head's own `bias`."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.norm = make_norm(c)
        self.bias = nn.Parameter(torch.zeros(c.vocab_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(h)))


class BertModel(Transformer):
    def __init__(self, c: ModelConfig, spec: BertSpec):
        check_config(c)
        super().__init__(c)
        self.spec = spec
        self.token_type_embed = nn.Embedding(spec.num_tokentypes, c.hidden_size) if spec.num_tokentypes else None
        self.mlm_head = MLMHead(c)
        self.pooler = nn.Linear(c.hidden_size, c.hidden_size) if spec.binary_head else None
        self.nsp_head = nn.Linear(c.hidden_size, 2) if spec.binary_head else None

    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """inputs (B, 3, T) -> (MLM logits (B, T, V), NSP logits (B, 2) or None). Under sequence parallel the
        embeddings are this rank's part of the sequence (tensor_parallel.py); the key mask is the whole one's."""
        tokens, types, padding = inputs[:, 0], inputs[:, 1], inputs[:, 2]
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens) + self.pos_embed(positions)
        if self.token_type_embed is not None:
            h = h + self.token_type_embed(types)
        ctx = LayerContext(None, positions, None, causal=False, key_mask=padding.bool()[:, None, None, :])
        for layer in self.layers.values():
            h = layer(h, ctx)
        h = self.final_norm(h)  # whole sequences from here on (tensor_parallel.py gathers them)
        x = self.mlm_head(h)
        weight = self.embed.weight
        if isinstance(weight, DTensor):  # vocab-split rows: vocab-sharded logits, never gathered
            x = DTensor.from_local(x, weight.device_mesh, [Replicate()], run_check=False)
        logits = F.linear(x, weight) + self.mlm_head.bias
        nsp = self.nsp_head(torch.tanh(self.pooler(h[:, 0]))) if self.pooler is not None else None
        return logits, nsp


def bert_losses(output: tuple[torch.Tensor, torch.Tensor | None], labels: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(MLM cross entropy over the labelled positions, NSP cross entropy or None); labels (B, T + 1) as
    split_batch makes them. In fp32 at least (a float64 model stays float64)."""
    logits, nsp = output
    dtype = torch.promote_types(logits.dtype, torch.float32)
    loss = F.cross_entropy(logits.flatten(0, 1).to(dtype), labels[:, :-1].flatten(), ignore_index=IGNORE)
    if nsp is None:
        return loss, None
    nsp_loss = F.cross_entropy(nsp.to(dtype), labels[:, -1])
    if isinstance(loss, DTensor):  # under loss_parallel the MLM loss is a replicated DTensor
        nsp_loss = DTensor.from_local(nsp_loss, loss.device_mesh, [Replicate()], run_check=False)
    return loss, nsp_loss


def bert_loss(output: tuple[torch.Tensor, torch.Tensor | None], labels: torch.Tensor) -> torch.Tensor:
    """The training loss: MLM loss + NSP loss (bert_losses)."""
    mlm, nsp = bert_losses(output, labels)
    return mlm if nsp is None else mlm + nsp


def nsp_correct(output: tuple[torch.Tensor, torch.Tensor | None], labels: torch.Tensor) -> int:
    """How many samples the NSP head classifies right (0 without it)."""
    nsp = output[1]
    return 0 if nsp is None else int((nsp.argmax(-1) == labels[:, -1]).sum())


@dataclass
class BertEval:
    mlm_loss: float  # mean cross entropy per predicted token
    nsp_loss: float | None  # mean per sample (binary head only)
    nsp_accuracy: float | None
    predicted_tokens: int
    samples: int


@torch.no_grad()
def evaluate(model: BertModel, batches) -> BertEval:
    """MLM loss over every predicted token of `batches` ((inputs, labels) pairs), NSP loss and accuracy over their
    samples; one process."""
    mlm = nsp = 0.0
    correct = tokens = samples = 0
    for inputs, labels in batches:
        logits, nsp_logits = model(inputs)
        targets = labels[:, :-1].flatten()
        mlm += float(F.cross_entropy(logits.flatten(0, 1).double(), targets, ignore_index=IGNORE, reduction="sum"))
        tokens += int((targets != IGNORE).sum())
        samples += len(labels)
        if nsp_logits is not None:
            nsp += float(F.cross_entropy(nsp_logits.double(), labels[:, -1], reduction="sum"))
            correct += int((nsp_logits.argmax(-1) == labels[:, -1]).sum())
    has_nsp = model.nsp_head is not None and samples
    return BertEval(mlm / max(tokens, 1), nsp / samples if has_nsp else None,
                    correct / samples if has_nsp else None, tokens, samples)
