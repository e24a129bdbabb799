"""Evaluate and generate with any checkpoint mconvert reads (HF, Megatron, mtrain, ...)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mconvert import engine
from mconvert.ir import ModelIR
from mconvert.options import Options
from mtrain import weights
from mtrain.data.gpt_dataset import GPTDataset
from mtrain.data.indexed import IndexedDataset
from mtrain.errors import TrainError
from mtrain.models.model import Transformer
from mtrain.parallelize import build_model


def load_model(path: str | Path, loader: str | None = None) -> tuple[Transformer, ModelIR]:
    """An fp32 model in eval mode holding the weights of the checkpoint at `path` (format detected)."""
    ir = engine.load(Path(path), Options(), loader)
    model = build_model(ir.config, device=torch.device("cpu"))
    weights.load_full_weights(model, weights.ir_weights(ir))
    return model.eval(), ir


@dataclass(frozen=True)
class EvalResult:
    loss: float
    perplexity: float
    samples: int
    tokens: int


@torch.no_grad()
def evaluate(model: Transformer, prefixes: list[str], *, seq_len: int, batch_size: int = 8,
             max_samples: int | None = None, cache_dir: Path | None = None) -> EvalResult:
    """Mean next-token loss over consecutive (unshuffled) seq_len windows of whole datasets."""
    if seq_len > model.config.max_position_embeddings and model.config.position_embedding == "learned":
        raise TrainError(f"--seq-len {seq_len} exceeds the model's {model.config.max_position_embeddings} positions")
    windows: list[np.ndarray] = []
    for prefix in prefixes:
        indexed = IndexedDataset(prefix)
        ds = GPTDataset(indexed, np.arange(len(indexed)), seq_len=seq_len, num_samples=None, seed=0,
                        cache_dir=cache_dir, name="evaluation", shuffle=False)
        windows.extend(ds[i] for i in range(len(ds)))
    if max_samples:
        windows = windows[:max_samples]
    total, tokens = 0.0, 0
    for start in range(0, len(windows), batch_size):
        batch = torch.from_numpy(np.stack(windows[start:start + batch_size]))
        if int(batch.max()) >= model.config.vocab_size:
            raise TrainError(f"the data holds token id {int(batch.max())}, outside the model's vocabulary of "
                             f"{model.config.vocab_size}")
        logits = model(batch[:, :-1])
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"))
        tokens += batch[:, 1:].numel()
    loss = total / max(tokens, 1)
    return EvalResult(loss, math.exp(min(loss, 50.0)), len(windows), tokens)


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], *, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, greedy: bool = False, seed: int = 0,
             eos_id: int | None = None) -> list[int]:
    """Continue `prompt` token by token (the whole sequence is re-run each step: a tool to eyeball a model)."""
    if not prompt:
        raise TrainError("the prompt is empty")
    g = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    limit = model.config.max_position_embeddings
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-limit:]])
        logits = model(context)[0, -1].float()
        if greedy or temperature <= 0:
            nxt = int(logits.argmax())
        else:
            nxt = int(torch.multinomial(filter_probs(logits / temperature, top_k, top_p), 1, generator=g))
        tokens.append(nxt)
        if eos_id is not None and nxt == eos_id:
            break
    return tokens[len(prompt):]


def filter_probs(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Probabilities restricted to the k most likely tokens and/or the smallest set holding mass top_p."""
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    if top_p is not None and 0 < top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass of the tokens ranked above each one
        sorted_probs[before >= top_p] = 0.0  # the top token always stays (before = 0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs
