"""Text generation: batched prompts, a key/value cache, greedy / top-k / top-p sampling.

Prompts of different lengths run as one batch the way Megatron-LM's text generation does: the batch starts at the
shortest prompt's length, and at each later position a row still inside its prompt is fed its own next prompt
token instead of the sampled one. Every row then shares the same positions, so no padding mask is needed:

    prompts  a b c          position:  0 1 2 3 4 5
             d e            row 0:     a b c > > >      (> sampled)
                            row 1:     d e > > > .      (max_new_tokens 3: row 1 is done at position 4)
    first pass: positions 0-1 of both rows (the prompt part they share), then one position per step

With the cache (kv_cache.py) each step runs one new position through the model; without it the whole sequence
is run again every step (kept as the reference the cache is tested and benchmarked against).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mconvert.ir.config import ModelConfig
from mtrain.errors import TrainError
from mtrain.models.kv_cache import KVCache
from mtrain.models.model import Transformer


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: the most likely one (greedy, or temperature 0), else a draw from the
    softmax of logits / temperature restricted to the top_k tokens and/or the top_p probability mass."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature <= 0


def check_fits(config: ModelConfig, longest_prompt: int, max_new_tokens: int) -> None:
    """Refuse (rather than cut the context) a generation longer than the model's positions."""
    total = longest_prompt + max_new_tokens
    if total > config.max_position_embeddings:
        room = config.max_position_embeddings - longest_prompt
        hint = f"ask for at most {room} new tokens" if room > 0 else "shorten the prompt"
        raise TrainError(f"a prompt of {longest_prompt} tokens plus {max_new_tokens} new tokens needs {total} "
                         f"positions; the model has {config.max_position_embeddings} (max_position_embeddings): "
                         f"{hint}")


@torch.inference_mode()  # lighter than no_grad: no version counters or views tracked for autograd
def generate_batch(model: Transformer, prompts: list[list[int]], *, max_new_tokens: int,
                   sampling: Sampling = Sampling(), seed: int = 0, eos_ids: Collection[int] = (),
                   use_cache: bool = True) -> list[list[int]]:
    """The new tokens of each prompt: `max_new_tokens` of them, or fewer when an eos id comes (it is kept)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise TrainError("every prompt needs at least one token")
    if max_new_tokens < 0:
        raise TrainError(f"max_new_tokens must be at least 0, got {max_new_tokens}")
    vocab = model.config.vocab_size
    bad = sorted({t for p in prompts for t in p if not 0 <= t < vocab})
    if bad:
        raise TrainError(f"token id(s) {', '.join(map(str, bad[:5]))} outside the model's vocabulary of {vocab}")
    lengths = [len(p) for p in prompts]
    check_fits(model.config, max(lengths), max_new_tokens)
    device = next(model.parameters()).device
    ends = [n + max_new_tokens for n in lengths]  # each row stops there, or after its eos
    total = max(ends)
    tokens = torch.zeros(len(prompts), total, dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        tokens[row, :len(p)] = torch.tensor(p, dtype=torch.long)
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache(batch=len(prompts), max_len=total) if use_cache else None
    eos = set(eos_ids)
    stop = list(ends)  # exclusive end of each row's output
    fed = 0  # positions already run through the model (with the cache)
    for pos in range(min(lengths), total):
        if all(pos >= s for s in stop):
            break
        if cache is not None:
            logits = model(tokens[:, fed:pos], cache=cache)[:, -1]  # (B, V)
            fed = pos
        else:
            logits = model(tokens[:, :pos])[:, -1]
        chosen = next_tokens(logits.float(), sampling, generator)  # (B,)
        for row in range(len(prompts)):
            if lengths[row] <= pos < stop[row]:  # inside the prompt the prompt's own token stays
                tokens[row, pos] = chosen[row]
                if int(chosen[row]) in eos:
                    stop[row] = pos + 1
    return [tokens[row, n:stop[row]].tolist() for row, n in enumerate(lengths)]


def generate(model: Transformer, prompt: list[int], *, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, greedy: bool = False, seed: int = 0,
             eos_id: int | None = None, use_cache: bool = True) -> list[int]:
    """The continuation of one prompt (see generate_batch)."""
    return generate_batch(model, [prompt], max_new_tokens=max_new_tokens,
                          sampling=Sampling(greedy, temperature, top_k, top_p), seed=seed,
                          eos_ids=() if eos_id is None else (eos_id,), use_cache=use_cache)[0]


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """(B, V) logits -> (B,) chosen token ids."""
    if sampling.is_greedy:
        return logits.argmax(dim=-1)
    probs = filter_probs(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def filter_probs(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Probabilities (over the last dim) restricted to the k most likely tokens and/or the smallest set holding
    mass top_p (the most likely token always stays)."""
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    if top_p is not None and 0 < top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above each one
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def eos_ids_of(config: ModelConfig, tokenizer_eos: int | None) -> tuple[int, ...]:
    """The ids that end a generation: the tokenizer's eos, else the model config's eos_token_id(s)."""
    if tokenizer_eos is not None:
        return (tokenizer_eos,)
    eos = config.eos_token_id
    return () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
