"""BERT encoders (IR families megatron_bert and bert) with their MLM head, pooler and next-sentence head.

    inputs (B, 3, T): tokens, token types, padding mask (1 = a real token)
    h = embed(tokens) + pos_embed(positions) [+ token_type_embed(types)]      [then embed_norm: post_norm]
    layers["0"] … layers["L-1"]: bidirectional attention (padding keys masked), Megatron's pre-LN Blocks, or
        HF BERT's post-LN ones (post_norm: h = attn_norm(h + attn(h)); h = mlp_norm(h + mlp(h)))
    h = final_norm(h)                                                          (pre-LN only)
    MLM logits (B, T, V) = lm_head(mlm_head.norm(act(mlm_head.dense(h)))) + lm_head.bias   (lm_head: embed when tied)
    NSP logits (B, 2)    = nsp_head(tanh(pooler(h[:, 0])))                     (binary_head)

Parameters are the IR's names (mconvert/ir/names.py, the meaning in mconvert/ir/features.py). `whole_sequence` is
applied to the hidden states before the heads: tensor parallel with sequence parallel gathers the sequence there
(parallel/tensor_parallel.py); one process leaves them as they are.

Loss (Megatron's pretrain_bert): the mean cross entropy over the predicted (masked) positions of a micro-batch,
plus, with the binary head, the mean NSP cross entropy over its samples.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from mconvert.ir.config import ModelConfig
from mtrain.data.bert_dataset import IGNORE
from mtrain.models.model import Block, LayerContext, Transformer, make_norm


class MLMHead(nn.Module):
    """The MLM head's transform: norm(act(dense(h))), act the IR's mlm_head_activation (exact or tanh GELU)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.approximate = "tanh" if c.mlm_head_activation == "gelu_tanh" else "none"
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.norm = make_norm(c)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(h), approximate=self.approximate))


class OutputBias(nn.Module):
    """The LM head's bias alone (`lm_head.bias`) when its weight is the tied embedding."""

    def __init__(self, size: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(size))


class PostNormBlock(Block):
    """HF BERT's post-LN layer: h = attn_norm(h + attn(h)); h = mlp_norm(h + mlp(h))."""

    def forward(self, h: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        h = self.attn_norm(h + self.attn(h, ctx))
        return self.mlp_norm(h + self.mlp(h))


class BertModel(Transformer):
    """A whole BERT, or a pipeline stage of one (`layers`, `first`, `last` as for Transformer): the first stage holds
    the embeddings, the last the heads."""

    def __init__(self, c: ModelConfig, *, layers: Iterable[int] | None = None, first: bool = True,
                 last: bool = True):
        super().__init__(c, layers=layers, first=first, last=last)
        if c.post_norm:
            self.layers = nn.ModuleDict({key: PostNormBlock(c, int(key)) for key in self.layers})
            self.embed_norm = make_norm(c) if first else None
            self.final_norm = nn.Identity() if last else None  # none in post-LN BERT (kept: a last stage's mark)
        self.token_type_embed = nn.Embedding(c.num_tokentypes, c.hidden_size) if c.num_tokentypes and first else None
        self.mlm_head = MLMHead(c) if last else None
        if last and not c.tie_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=c.lm_head_bias)
        elif last and c.lm_head_bias:
            self.lm_head = OutputBias(c.vocab_size)
        self.pooler = nn.Linear(c.hidden_size, c.hidden_size) if c.pooler and last else None
        self.nsp_head = nn.Linear(c.hidden_size, 2) if c.binary_head and last else None
        self.whole_sequence = lambda h: h

    def forward(self, inputs: torch.Tensor, padding: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None] | torch.Tensor:
        """inputs (B, 3, T) -> (MLM logits (B, T, V), NSP logits (B, 2) or None). Under sequence parallel the
        embeddings and layers hold this rank's part of the sequence; the key mask is the whole one's. A pipeline
        stage after the first takes hidden states and the padding mask (B, T) (the schedule hands every stage
        its micro-batch's); one before the last returns hidden states."""
        if self.embeds_tokens:
            tokens, types, padding = inputs[:, 0], inputs[:, 1], inputs[:, 2]
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.embed(tokens) + self.pos_embed(positions)
            if self.token_type_embed is not None:
                h = h + self.token_type_embed(types)
            if self.config.post_norm:
                h = self.embed_norm(h)
        else:
            h, positions = inputs, torch.arange(padding.shape[1], device=padding.device)
        ctx = LayerContext(None, positions, None, causal=False, key_mask=padding.bool()[:, None, None, :])
        for layer in self.layers.values():
            h = layer(h, ctx)
        if self.final_norm is None:
            return h
        h = self.whole_sequence(self.final_norm(h))
        x = self.mlm_head(h)
        weight = self.embed.weight if self.config.tie_embeddings else self.lm_head.weight
        if isinstance(weight, DTensor):  # vocab-split rows: vocab-sharded logits, never gathered
            x = DTensor.from_local(x, weight.device_mesh, [Replicate()], run_check=False)
        logits = F.linear(x, weight)
        if self.config.lm_head_bias:
            logits = logits + self.lm_head.bias
        nsp = self.nsp_head(torch.tanh(self.pooler(h[:, 0]))) if self.nsp_head is not None else None
        return logits, nsp


def bert_losses(output: tuple[torch.Tensor, torch.Tensor | None], labels: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(MLM cross entropy over the labelled positions, NSP cross entropy or None); labels (B, T + 1) as
    split_batch makes them. In fp32 at least (a float64 model stays float64)."""
    logits, nsp = output
    dtype = torch.promote_types(logits.dtype, torch.float32)
    predicted = int((labels[:, :-1] != IGNORE).sum())  # 0 is possible (Megatron masks none below 1/p tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).to(dtype), labels[:, :-1].flatten(), ignore_index=IGNORE,
                           reduction="sum") / max(predicted, 1)
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
