"""The key/value cache of incremental decoding: each layer keeps what its attention computed for earlier positions.

    cache = KVCache(batch=B, max_len=S)         S: the longest sequence this generation reaches
    logits = model(prompt, cache=cache)          (B, T0) tokens at positions 0 … T0-1; every layer stores them
    logits = model(next_tokens, cache=cache)     (B, 1) at position T0 (cache.length); attends to all T0 + 1
    cache.length                                 positions seen so far

The model reaches its layer's slot through `LayerContext.cache` (a `LayerCache`) and appends what it has to keep
for later positions; what that is belongs to the attention variant:

    standard / grouped-query attention   k, v after rotary: (B, ng, T, hd) each, appended along dim 2
    multi-latent attention (mla.py)      kv_norm(latent) (B, T, r) and the rotated shared key (B, 1, T, dr):
                                         append(latent, k_rope, dim=(1, 2)); keys and values re-expanded from them

Buffers are allocated on the first append with room for `max_len` positions, so a step copies only its new
entries. A cache serves one sequence batch from position 0 onwards; build a new one per generation.

A sliding-window layer (window w: a query sees itself and the w - 1 positions before it) keeps only the last w - 1
positions between calls: an append returns those and the new ones (a contiguous run of positions ending at the last
new one, which is how the attention places them), then drops what no later query can see. Its memory is bounded by
the window, not by `max_len`.
"""

from __future__ import annotations

import torch

from mtrain.errors import TrainError


class LayerCache:
    """One layer's cached tensors, each growing along its own sequence dimension (with a `window`: only the last
    window - 1 positions are kept)."""

    def __init__(self, max_len: int, window: int | None = None):
        self.max_len, self.window = max_len, window
        self.length = 0  # positions seen (the stored ones are the last of them)
        self.buffers: list[torch.Tensor] = []

    def append(self, *new: torch.Tensor, dim: int | tuple[int, ...] = 2) -> tuple[torch.Tensor, ...]:
        """Store `new` (the current positions) after the earlier ones; return every position so far, per tensor.

        `dim`: the sequence dimension, one for all tensors or one per tensor. The tensors of one layer are
        appended together, in the same order every call."""
        dims = dim if isinstance(dim, tuple) else (dim,) * len(new)
        count = new[0].shape[dims[0]]
        if len(dims) != len(new) or any(t.shape[d] != count for t, d in zip(new, dims)):
            raise TrainError(f"a layer cache append needs one sequence dim per tensor and the same number of new "
                             f"positions in each; got dims {dims} for shapes {[list(t.shape) for t in new]}")
        end = self.length + count
        if end > self.max_len:
            raise TrainError(f"the key/value cache holds {self.max_len} positions; {end} were asked for")
        if self.buffers and len(new) != len(self.buffers):
            raise TrainError(f"a layer cache of {len(self.buffers)} tensors was given {len(new)}")
        if self.window is not None:
            return self._append_windowed(new, dims, end)
        if not self.buffers:
            self.buffers = [_empty_like_along(t, d, self.max_len) for t, d in zip(new, dims)]
        out = []
        for buffer, t, d in zip(self.buffers, new, dims):
            buffer.narrow(d, self.length, count).copy_(t)
            out.append(buffer.narrow(d, 0, end))
        self.length = end
        return tuple(out)


    def _append_windowed(self, new: tuple[torch.Tensor, ...], dims: tuple[int, ...], end: int
                         ) -> tuple[torch.Tensor, ...]:
        out = tuple(torch.cat([b, t], dim=d) if self.buffers else t for b, t, d in
                    zip(self.buffers or new, new, dims))
        keep = self.window - 1  # what the next query (at position `end`) still sees besides itself
        self.buffers = [t.narrow(d, max(t.shape[d] - keep, 0), min(keep, t.shape[d])).clone()
                        for t, d in zip(out, dims)]
        self.length = end
        return out


class KVCache:
    """The caches of every layer of a model (or pipeline stage), keyed by global layer index."""

    def __init__(self, *, batch: int, max_len: int):
        self.batch, self.max_len = batch, max_len
        self.length = 0  # positions the model has been run on
        self.layers: dict[int, LayerCache] = {}

    def layer(self, index: int, window: int | None = None) -> LayerCache:
        """Layer `index`'s cache; `window`: its sliding window (fixed by the first call)."""
        if index not in self.layers:
            self.layers[index] = LayerCache(self.max_len, window)
        return self.layers[index]

    def positions(self, count: int, device: torch.device | None = None) -> torch.Tensor:
        """The positions of the next `count` tokens: (count,)."""
        if self.length + count > self.max_len:
            raise TrainError(f"the key/value cache holds {self.max_len} positions; {self.length + count} were asked "
                             "for")
        return torch.arange(self.length, self.length + count, device=device)

    def advance(self, count: int) -> None:
        """After a forward pass over `count` new tokens."""
        self.length += count


def _empty_like_along(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = size
    return torch.empty(shape, dtype=t.dtype, device=t.device)
