"""Training throughput: mtrain against a minimal plain-PyTorch loop (one process), and mtrain's parallel layouts.

    python bench/train.py [--rounds 5] [--steps 4] [--layers 6] [--hidden 384] [--seq 256] [--batch 4]
    python bench/train.py --layouts [--ranks 2] [--rounds 3] [--steps 4] ...     (see bench/train_layouts.py)

The model is a small GPT (GPT-2 style: learned positions, LayerNorm, GELU, tied embeddings). Three variants
train it from the same initial weights with AdamW and gradient clipping:

    mtrain      mtrain's Trainer: data pipeline (indexed dataset on disk), LR schedule, clipping, logging
    plain       a nanoGPT-style model (fused QKV) in a bare loop over in-memory batches
    plain+mtm   the same bare loop driving mtrain's model (isolates the trainer's overhead)

This machine's speed drifts by several times within seconds, so the variants run interleaved step by step (in
rotating order), and the figure that counts is each round's ratio (median over rounds), not a lone tokens/s.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtrain import weights  # noqa: E402
from mtrain.config import from_dict  # noqa: E402
from mtrain.data.indexed import IndexedDatasetWriter  # noqa: E402
from mtrain.train import Trainer  # noqa: E402


class PlainBlock(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.c_attn, self.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, seq: int, h: int, heads: int, layers: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(PlainBlock(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def copy_weights(plain: PlainGPT, mtrain_model: nn.Module) -> None:
    """Start the plain model from mtrain's initial weights (q, k, v fused into c_attn)."""
    p = weights.named_parameters(mtrain_model)
    with torch.no_grad():
        plain.wte.weight.copy_(p["embed.weight"])
        plain.wpe.weight.copy_(p["pos_embed.weight"][: plain.wpe.weight.shape[0]])
        for i, b in enumerate(plain.blocks):
            g = f"layers.{i}."
            for ln, name in ((b.ln_1, "attn_norm"), (b.ln_2, "mlp_norm")):
                ln.weight.copy_(p[g + name + ".weight"])
                ln.bias.copy_(p[g + name + ".bias"])
            b.c_attn.weight.copy_(torch.cat([p[g + f"attn.{n}.weight"] for n in "qkv"]))
            b.c_attn.bias.copy_(torch.cat([p[g + f"attn.{n}.bias"] for n in "qkv"]))
            for lin, name in ((b.c_proj, "attn.o"), (b.fc, "mlp.up"), (b.proj, "mlp.down")):
                lin.weight.copy_(p[g + name + ".weight"])
                lin.bias.copy_(p[g + name + ".bias"])
        plain.ln_f.weight.copy_(p["final_norm.weight"])
        plain.ln_f.bias.copy_(p["final_norm.bias"])


def plain_step(model, optimizer, tokens):
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def make_data(root: Path, vocab: int, tokens: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(root / "bench_text_document", np.uint16)
    written = 0
    while written < tokens:
        n = int(rng.integers(100, 2000))
        writer.add_document(rng.integers(0, vocab, n))
        written += n
    writer.finalize()
    return str(root / "bench_text_document")


def main() -> None:
    if "--peers" in sys.argv:
        from train_peers import main as peers_main  # noqa: E402

        return peers_main([a for a in sys.argv[1:] if a != "--peers"])
    if "--layouts" in sys.argv or "--worker" in sys.argv:
        from train_layouts import main as layouts_main  # noqa: E402  (bench/ is on sys.path as the script's dir)

        return layouts_main([a for a in sys.argv[1:] if a != "--layouts"])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per variant per round")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    h, L, S, B, V = args.hidden, args.layers, args.seq, args.batch, args.vocab
    total_steps = (args.rounds + 1) * args.steps
    tmp = Path(tempfile.mkdtemp(prefix="mtrain-bench-"))
    prefix = make_data(tmp, V, total_steps * B * (S + 1) * 2)
    config = from_dict({
        "model": dict(family="gpt2", num_layers=L, hidden_size=h, ffn_hidden_size=4 * h, num_attention_heads=args.heads,
                      num_query_groups=args.heads, head_dim=h // args.heads, vocab_size=V,
                      max_position_embeddings=S, norm="layernorm", activation="gelu_tanh",
                      position_embedding="learned", qkv_bias=True, proj_bias=True, mlp_bias=True, tie_embeddings=True),
        "data": {"paths": [prefix], "seq_len": S, "split": "100,0,0", "cache_dir": str(tmp / "cache")},
        "train": {"steps": total_steps * 10, "micro_batch_size": B, "global_batch_size": B},
        "optim": {"lr": 3e-4, "warmup_steps": 10, "weight_decay": 0.1, "grad_clip": 1.0},
        "logging": {"interval": 10**9},
    })
    trainer = Trainer(config, out=lambda _: None)

    plain = PlainGPT(V, S, h, args.heads, L)
    copy_weights(plain, trainer.model)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    bare = Trainer(config, out=lambda _: None).model  # mtrain's model driven by the plain loop
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, V, (B, S + 1), generator=g) for _ in range(8)]

    def run_mtrain(n):
        for _ in range(n):
            trainer.train_step()

    def run_plain(model, opt):
        def go(n):
            for i in range(n):
                plain_step(model, opt, batches[i % len(batches)])
        return go

    variants = {"mtrain": run_mtrain, "plain": run_plain(plain, plain_opt), "plain+mtm": run_plain(bare, bare_opt)}
    for fn in variants.values():  # warm-up round, not timed
        fn(1)
    tokens = args.steps * B * S
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    print(f"small GPT: {L} layers, hidden {h}, {args.heads} heads, seq {S}, batch {B}, vocab {V}, "
          f"{torch.get_num_threads()} threads; {args.rounds} rounds x {args.steps} steps per variant")
    names = list(variants)
    for r in range(args.rounds):
        # Step by step, rotating the order: drift within a round hits every variant alike.
        spent = dict.fromkeys(names, 0.0)
        for k in range(args.steps):
            for name in names[k % len(names):] + names[:k % len(names)]:
                start = time.perf_counter()
                variants[name](1)
                spent[name] += time.perf_counter() - start
        for name in names:
            seconds[name].append(spent[name])
        line = " | ".join(f"{n} {tokens / seconds[n][-1]:8,.0f} tok/s" for n in variants)
        print(f"round {r + 1}: {line} | mtrain/plain {seconds['plain'][-1] / seconds['mtrain'][-1]:.3f}")
    ratio = [p / m for p, m in zip(seconds["plain"], seconds["mtrain"])]
    overhead = [p / m for p, m in zip(seconds["plain+mtm"], seconds["mtrain"])]
    print(f"mtrain / plain loop (tokens/s ratio, median of {args.rounds} rounds): {statistics.median(ratio):.3f} "
          f"(min {min(ratio):.3f}, max {max(ratio):.3f}); target >= 0.95")
    print(f"mtrain / plain loop on mtrain's own model (trainer overhead only): {statistics.median(overhead):.3f}")
    print("median tokens/s: " + ", ".join(f"{n} {tokens / statistics.median(s):,.0f}" for n, s in seconds.items()))
    assert math.isfinite(trainer.train_step()["loss"])


if __name__ == "__main__":
    main()
