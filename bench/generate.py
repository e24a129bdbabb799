"""Generation speed with and without the key/value cache (prints figures; not a test).

    python bench/generate.py [--new-tokens 400] [--repeats 2] [--batch 1] [--threads 1]

A random Llama of about 1.8M parameters (4 layers, hidden 128, vocabulary 4096, 512 positions) continues a
16-token prompt greedily. "no cache" runs the whole sequence again for every new token (what `mtrain generate`
did before the cache); "cache" runs one position per step. The runs are interleaved (this machine's speed drifts)
and the greedy outputs of both are checked to be identical.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mconvert.ir import ModelConfig
from mtrain import weights
from mtrain.generation import Sampling, generate_batch
from mtrain.parallelize import build_model

CONFIG = ModelConfig(family="llama", num_layers=4, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4,
                     num_query_groups=2, head_dim=32, vocab_size=4096, max_position_embeddings=512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="prompts generated together")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = build_model(CONFIG, device=torch.device("cpu"))
    names = [n for n, _ in model.named_parameters()]
    weights.load_full_weights(model, weights.random_init(CONFIG, 0, 0.02, names))
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CONFIG.vocab_size, (16,), generator=g).tolist() for _ in range(args.batch)]
    print(f"model: {params:,} parameters; {args.batch} prompt(s) of 16 tokens + {args.new_tokens} new tokens, "
          f"greedy, {args.threads} thread(s)")

    times: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list[list[int]]] = {}
    for _ in range(args.repeats):
        for use_cache in (False, True):  # interleaved
            start = time.perf_counter()
            outputs[use_cache] = generate_batch(model, prompts, max_new_tokens=args.new_tokens,
                                                sampling=Sampling(greedy=True), use_cache=use_cache)
            times[use_cache].append(time.perf_counter() - start)
    assert outputs[True] == outputs[False], "the cache changed the greedy output"
    new = args.new_tokens * args.batch
    for use_cache, label in ((False, "no cache"), (True, "cache")):
        best = min(times[use_cache])
        print(f"{label:>9}: best {best:7.2f} s, median {statistics.median(times[use_cache]):7.2f} s "
              f"({new / best:8.1f} tokens/s)")
    print(f"speed-up (best times): {min(times[False]) / min(times[True]):.1f}x; greedy outputs identical")


if __name__ == "__main__":
    main()
