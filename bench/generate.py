"""Generation speed with and without the key/value cache (prints figures; not a test).

    python bench/generate.py [--new-tokens 400] [--repeats 2] [--batch 1] [--threads 1]
    python bench/generate.py --vocab 4096 --hidden 128 --layers 4 --no-tie     # a deeper model, small vocabulary
    python bench/generate.py --mla      # DeepSeek's multi-latent attention (latent hidden/2, rotary part 4)

The default model is a random Llama of about 1.8M parameters sized like a small experiment on a real tokenizer:
a 32000-token vocabulary (tied embeddings, which hold most of the parameters), hidden 48, 4 layers, 512 positions.
It continues a 16-token prompt greedily. "no cache" runs the whole sequence again for every new token (what
`mtrain generate` did before the cache, including logits for every position); "cache" runs one position per step.
The runs are interleaved (this machine's speed drifts) and the greedy outputs of both are checked to be identical.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mconvert.ir.config import ModelConfig
from mtrain import weights
from mtrain.generation import Sampling, generate_batch
from mtrain.parallelize import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="prompts generated together")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=48)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--no-tie", dest="tie", action="store_false", help="a separate output head")
    parser.add_argument("--mla", action="store_true", help="multi-latent attention (a deepseek_v3 model, dense)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    heads = 4
    mla = dict(family="deepseek_v3", num_query_groups=heads, kv_lora_rank=args.hidden // 2, qk_rope_head_dim=4,
               v_head_dim=args.hidden // heads)
    config = ModelConfig(**dict(family="llama", num_layers=args.layers, hidden_size=args.hidden,
                                ffn_hidden_size=args.hidden * 3, num_attention_heads=heads, num_query_groups=heads // 2,
                                head_dim=args.hidden // heads, vocab_size=args.vocab, max_position_embeddings=512,
                                tie_embeddings=args.tie) | (mla if args.mla else {}))
    model = build_model(config, device=torch.device("cpu"))
    names = [n for n, _ in model.named_parameters()]
    weights.load_full_weights(model, weights.random_init(config, 0, 0.02, names))
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (16,), generator=g).tolist() for _ in range(args.batch)]
    print(f"model: {config.family}, {params:,} parameters (vocabulary {args.vocab}, hidden {args.hidden}, "
          f"{args.layers} layers, "
          f"{'tied' if args.tie else 'separate'} head); {args.batch} prompt(s) of 16 tokens + {args.new_tokens} new "
          f"tokens, greedy, {args.threads} thread(s)")

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
