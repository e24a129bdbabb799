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

BatchGeneration runs that loop one step at a time (the server's scheduler interleaves several), with rows in
RowGroups that each sample with their own settings and generator; generate_batch is one group run to the end.
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


@dataclass(frozen=True)
class RowGroup:
    """Rows of a batch that sample alike: one request's rows in the server, every row in generate_batch.

    `top_logprobs`: None for no log-probabilities; k >= 0 for each chosen token's log-probability under the
    model's distribution (before temperature and filtering) and the k most likely tokens' (see Emitted)."""

    rows: tuple[int, ...]
    sampling: Sampling
    generator: torch.Generator
    eos_ids: frozenset[int] = frozenset()
    top_logprobs: int | None = None


@dataclass(frozen=True)
class Emitted:
    """A token a row produced at one step; logprob and top (token, logprob) pairs when its group asked."""

    row: int
    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


class BatchGeneration:
    """generate_batch one position at a time, so that a caller (the server's scheduler) can interleave several
    batches and end rows early. Rows are split into RowGroups, each sampled with its own settings and generator."""

    def __init__(self, model: Transformer, prompts: list[list[int]], *, max_new_tokens: int | list[int],
                 groups: list[RowGroup], use_cache: bool = True):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise TrainError("every prompt needs at least one token")
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        if len(limits) != len(prompts) or any(m < 0 for m in limits):
            raise TrainError(f"max_new_tokens must be at least 0 for each of the {len(prompts)} prompts, got "
                             f"{max_new_tokens}")
        if sorted(r for g in groups for r in g.rows) != list(range(len(prompts))):
            raise TrainError(f"the row groups must cover rows 0 … {len(prompts) - 1} once each")
        vocab = model.config.vocab_size
        bad = sorted({t for p in prompts for t in p if not 0 <= t < vocab})
        if bad:
            raise TrainError(f"token id(s) {', '.join(map(str, bad[:5]))} outside the model's vocabulary of {vocab}")
        self.lengths = [len(p) for p in prompts]
        for n, m in zip(self.lengths, limits):
            check_fits(model.config, n, m)
        self.model, self.groups = model, groups
        device = next(model.parameters()).device
        self.stop = [n + m for n, m in zip(self.lengths, limits)]  # exclusive end of each row's output
        self.total = max(self.stop)
        self.tokens = torch.zeros(len(prompts), self.total, dtype=torch.long, device=device)
        for row, p in enumerate(prompts):
            self.tokens[row, :len(p)] = torch.tensor(p, dtype=torch.long)
        self.cache = KVCache(batch=len(prompts), max_len=self.total) if use_cache else None
        self.pos = min(self.lengths)  # the position the next step writes
        self.fed = 0  # positions already run through the model (with the cache)

    @property
    def done(self) -> bool:
        """Every row has produced what it may (a row with nothing to produce is done at once)."""
        return self.pos >= self.total or all(self.pos >= s or s <= n for s, n in zip(self.stop, self.lengths))

    def finish(self, row: int) -> None:
        """Produce nothing more for `row` (what it produced stays in outputs())."""
        self.stop[row] = min(self.stop[row], self.pos)

    def outputs(self) -> list[list[int]]:
        """The new tokens of each row so far (an eos that ended a row is kept)."""
        return [self.tokens[row, n:min(s, self.pos)].tolist() for row, (n, s) in enumerate(zip(self.lengths,
                                                                                                   self.stop))]

    @torch.inference_mode()  # lighter than no_grad: no version counters or views tracked for autograd
    def step(self) -> list[Emitted]:
        """Run one position; the tokens rows produced there (rows still inside their prompt produce none)."""
        pos = self.pos
        if self.cache is not None:
            logits = self.model(self.tokens[:, self.fed:pos], cache=self.cache)[:, -1]  # (B, V)
            self.fed = pos
        else:
            logits = self.model(self.tokens[:, :pos])[:, -1]
        logits = logits.float()
        emitted = []
        for group in self.groups:
            index = torch.tensor(group.rows, device=logits.device)
            chosen = next_tokens(logits[index], group.sampling, group.generator)  # (rows,)
            logp = torch.log_softmax(logits[index], dim=-1) if group.top_logprobs is not None else None
            for i, row in enumerate(group.rows):
                if not self.lengths[row] <= pos < self.stop[row]:  # inside the prompt its own token stays
                    continue
                token = int(chosen[i])
                self.tokens[row, pos] = token
                if token in group.eos_ids:
                    self.stop[row] = pos + 1
                if logp is None:
                    emitted.append(Emitted(row, token))
                    continue
                top = ()
                if group.top_logprobs:
                    values, ids = torch.topk(logp[i], min(group.top_logprobs, logp.shape[-1]))
                    top = tuple(zip(ids.tolist(), values.tolist()))
                emitted.append(Emitted(row, token, float(logp[i, token]), top))
        self.pos = pos + 1
        return emitted


def generate_batch(model: Transformer, prompts: list[list[int]], *, max_new_tokens: int,
                   sampling: Sampling = Sampling(), seed: int = 0, eos_ids: Collection[int] = (),
                   use_cache: bool = True) -> list[list[int]]:
    """The new tokens of each prompt: `max_new_tokens` of them, or fewer when an eos id comes (it is kept)."""
    device = next(model.parameters()).device
    group = RowGroup(tuple(range(len(prompts))), sampling, torch.Generator(device=device).manual_seed(seed),
                     frozenset(eos_ids))
    run = BatchGeneration(model, prompts, max_new_tokens=max_new_tokens, groups=[group], use_cache=use_cache)
    while not run.done:
        run.step()
    return run.outputs()


@torch.inference_mode()
def prompt_logprobs(model: Transformer, prompt: list[int], top: int = 0) -> list[Emitted]:
    """Each token of `prompt` after the first with its log-probability given the tokens before it, and the `top`
    most likely tokens' there (row 0)."""
    ids = torch.tensor([prompt], dtype=torch.long, device=next(model.parameters()).device)
    logp = torch.log_softmax(model(ids)[0, :-1].float(), dim=-1)
    chosen = logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()
    tops = torch.topk(logp, min(top, logp.shape[-1]), dim=-1) if top else None
    return [Emitted(0, token, value, tuple(zip(tops.indices[i].tolist(), tops.values[i].tolist())) if tops else ())
            for i, (token, value) in enumerate(zip(prompt[1:], chosen))]


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
