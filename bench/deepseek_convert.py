"""DeepSeek-V3 conversion: the 671B model planned on paper, and a scaled-down one measured.

    python bench/deepseek_convert.py plan [--disk-gbps 1 2 5] [--tp 1 --pp 16 --first 4 --last 1 --ep 8 --etp 1]
    python bench/deepseek_convert.py measure [--workdir DIR] [--repeat N]

`plan` runs mconvert's own planning code on DeepSeek-V3's published config (no bytes read): the FP8 release's
bytes (FP8 linear weights + float32 128x128 block scales, bf16 elsewhere), what the core saver writes (bf16, in
torch_dist and in a torch layout where every EP rank's files repeat the dense weights), the largest single step of
the streaming conversion (the IR tensors of one checkpoint tensor plus its pieces: peak memory beyond page cache)
and the largest layer (what a layer-at-a-time converter would hold), and the time at the stated disk speeds, read
and write sharing one disk.

`measure` builds an FP8 DeepSeek-V3-shaped model scaled down (tensor by tensor, never whole in memory) and times,
interleaved with `cp` of the same bytes, FP8 HF -> core torch_dist, FP8 HF -> core torch TP2 PP2 EP4 and
torch_dist -> HF FP8, each in its own process; memory is the peak RssAnon + RssShmem of the process tree (see
bench/convert.py). It then scales the measured rate to the 671B byte counts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from convert import run_measured  # noqa: E402

from mconvert.hf import deepseek as hf_deepseek  # noqa: E402
from mconvert.io import hf_dir  # noqa: E402
from mconvert.io.safetensors import Entry  # noqa: E402
from mconvert.ir.config import ModelConfig  # noqa: E402
from mconvert.ir.names import expected_shapes  # noqa: E402
from mconvert.megatron import core, rank_plan
from mconvert.rules import fp8  # noqa: E402
from mconvert.rules.layout import ParallelLayout  # noqa: E402
from mconvert.rules.mapping import expand  # noqa: E402
from mconvert.rules.table import Ctx  # noqa: E402
from mconvert.rules.transforms import padded_vocab_size  # noqa: E402

# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3), the fields that shape the weights
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
               "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
               "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 163840,
               "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16", "rope_theta": 10000,
               "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}
# The same shape scaled down for the measured run (8 layers, 3 dense, 64 experts, one MTP layer)
SMALL = DEEPSEEK_V3 | {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
                       "moe_intermediate_size": 256, "num_hidden_layers": 8, "num_attention_heads": 8,
                       "num_key_value_heads": 8, "n_routed_experts": 64, "kv_lora_rank": 128, "q_lora_rank": 384,
                       "qk_rope_head_dim": 32, "v_head_dim": 64, "qk_nope_head_dim": 64}
GB = 1e9


def hf_entries(config: ModelConfig) -> list[Entry]:
    """The FP8 release's tensors: FP8 linear weights with their scales, bf16 otherwise (float32 score bias)."""
    return [e for e, _ in _entries(config)]


def _entries(config: ModelConfig) -> list[tuple[Entry, str]]:
    """(entry, the IR tensor it holds) of the FP8 release."""
    shapes, entries = expected_shapes(config), []
    for row in expand(hf_deepseek.SAVE_TABLE, config):
        shape = shapes[row.ir[0]]
        if hf_deepseek.is_fp8_weight(row.key):
            entries += [(Entry(row.key, shape, fp8.FP8), row.ir[0]),
                        (Entry(row.key + fp8.SCALE_SUFFIX, fp8.scale_shape(shape), torch.float32), row.ir[0])]
        else:
            entries.append((Entry(row.key, shape, torch.float32 if row.key.endswith("bias") else torch.bfloat16),
                            row.ir[0]))
    return entries


def nbytes(shape, dtype=torch.bfloat16) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def core_plan(config: ModelConfig, layout: ParallelLayout) -> tuple[int, int, int, int, str, int]:
    """(bytes written, files, largest step, largest layer, the largest step's key, largest file) of a torch-format
    core checkpoint in `layout`, from the saver's own plan (shapes only)."""
    padded = padded_vocab_size(config.vocab_size, 128, layout.tp)
    ctx = Ctx(config, padded, tp=layout.tp, etp=layout.expert_tp, local_experts=config.num_experts // layout.ep)
    parts = rank_plan.plan(core.table("te", "grouped", mla=True), config, layout.chunks(config.num_layers),
                           ep=layout.ep, entry_names=rank_plan.entries(layout.vpp), tied_copy=core.TIED_OUTPUT,
                           embed_copy=core.MTP_EMBEDDING)
    shapes = expected_shapes(config)
    written, step, step_key, files = 0, 0, "", {}
    for part in parts:
        for row in part.rows + part.copies:
            pieces = row.rule.piece_shapes([shapes[n] for n in row.ir], ctx)
            inputs = sum(nbytes(shapes[n]) for n in row.ir)
            out = sum(nbytes(p) for p in pieces)
            written += out
            for tp in range(layout.tp):
                files[(part.chunk.pp, part.ep, tp)] = files.get((part.chunk.pp, part.ep, tp), 0) + nbytes(pieces[tp])
            if inputs + out > step:  # the IR tensors (dequantized) + the joined tensor's pieces
                step, step_key = inputs + out, row.key
    layers: dict[str, int] = {}
    for name, shape in shapes.items():
        if name.startswith("layers."):
            layers[name.split(".")[1]] = layers.get(name.split(".")[1], 0) + nbytes(shape)
    return written, len(files), step, max(layers.values()), step_key, max(files.values())


def plan(args) -> None:
    config = hf_deepseek.config_from_hf(DEEPSEEK_V3, "DeepSeek-V3 config.json")
    entries = hf_entries(config)
    read = sum(nbytes(e.shape, e.dtype) for e in entries)
    ir = sum(nbytes(s, torch.float32 if n.endswith("expert_bias") else torch.bfloat16)
             for n, s in expected_shapes(config).items())
    params = sum(torch.Size(s).numel() for s in expected_shapes(config).values())
    fp8_params = sum(torch.Size(e.shape).numel() for e in entries if e.dtype == fp8.FP8)
    layout = ParallelLayout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, first_stage_layers=args.first,
                            last_stage_layers=args.last)
    written, files, step, layer, step_key, largest = core_plan(config, layout)
    print(f"DeepSeek-V3: {params / 1e9:.1f} B parameters ({config.num_layers} layers + {config.mtp_layers} MTP, "
          f"{config.num_experts} experts), {fp8_params / 1e9:.1f} B of them FP8 in the release")
    print(f"read   FP8 release (+ scales, bf16 rest)      {read / GB:8.1f} GB in {len(entries)} tensors")
    print(f"write  core torch_dist (bf16, written once)   {ir / GB:8.1f} GB")
    print(f"write  core torch {layout.describe():<22}  {written / GB:8.1f} GB in {files} files (largest "
          f"{largest / GB:.1f} GB; every EP rank's files repeat the dense weights)")
    print(f"peak   largest streaming step: {step / GB:.2f} GB ({step_key}: its IR tensors + pieces); largest "
          f"layer {layer / GB:.2f} GB (what a layer-at-a-time converter holds); dequantization adds one "
          f"float32 chunk ({fp8.CHUNK * 4 / 2**20:.0f} MiB, or one row where a row is longer)")
    print(f"{'disk GB/s':>10} {'-> torch_dist':>14} {'-> torch layout':>16}   (read + write on one disk)")
    for bw in args.disk_gbps:
        print(f"{bw:>10g} {(read + ir) / (bw * GB) / 60:11.0f} min {(read + written) / (bw * GB) / 60:13.0f} min")


def build_small(root: Path) -> int:
    """Write the scaled-down FP8 model tensor by tensor (each quantized as it is produced); returns its bytes."""
    config = hf_deepseek.config_from_hf(SMALL, "scaled-down DeepSeek-V3")
    holds, pending = {e.name: name for e, name in _entries(config)}, {}
    entries = hf_entries(config)

    def produce(e: Entry) -> torch.Tensor:
        if e.name.endswith(fp8.SCALE_SUFFIX):
            return pending.pop(e.name[:-len(fp8.SCALE_SUFFIX)])
        # seeded by the IR tensor, so the MTP layers' copies of the embedding and head are copies
        gen = torch.Generator().manual_seed(zlib.crc32(holds[e.name].encode()))
        value = torch.randn(e.shape, generator=gen) * 0.02
        if e.dtype == fp8.FP8:
            q, pending[e.name] = fp8.quantize(value)
            return q
        return value.to(e.dtype)

    class Quiet:
        def task(self, *a, **k):
            return contextlib.nullcontext(lambda n: None)

    root.mkdir(parents=True)
    hf_dir.write_weights(root, entries, produce, 2 * 10**9, Quiet())
    hf_dir.write_json(root / "config.json", SMALL | {"quantization_config": fp8.QUANTIZATION_CONFIG})
    return sum(nbytes(e.shape, e.dtype) for e in entries)


def measure(args) -> None:
    src, dist = args.workdir / "deepseek_fp8", args.workdir / "deepseek_torch_dist"
    if not (src / "config.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        t = time.perf_counter()
        print(f"built the scaled-down FP8 model ({build_small(src) / GB:.2f} GB) in {time.perf_counter() - t:.0f} s")
    mconvert = str(Path(sys.executable).with_name("mconvert"))
    if not (dist / "latest_checkpointed_iteration.txt").is_file():
        shutil.rmtree(dist, ignore_errors=True)
        subprocess.run([mconvert, "--quiet", "--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", str(src),
                        "--save-dir", str(dist)], check=True)
    convert = [mconvert, "--quiet", "--force"]
    variants = {
        "cp + sync": lambda dst: ["cp", "-r", str(src), str(dst)],
        "FP8 HF -> core torch_dist": lambda dst: [*convert, "--saver", "core", "--ckpt-format", "torch_dist",
                                                  "--load-dir", str(src), "--save-dir", str(dst)],
        "FP8 HF -> core TP2 PP2 EP4": lambda dst: [*convert, "--saver", "core", "--tp", "2", "--pp", "2", "--ep", "4",
                                                   "--load-dir", str(src), "--save-dir", str(dst)],
        "torch_dist -> HF FP8": lambda dst: [*convert, "--saver", "hf", "--fp8-weights", "--load-dir", str(dist),
                                             "--save-dir", str(dst)],
    }
    best: dict[str, tuple[float, int, int]] = {}
    for round_ in range(args.repeat):
        for name, make in variants.items():
            dst = args.workdir / "dst"
            shutil.rmtree(dst, ignore_errors=True)
            cpu = _children_cpu()
            seconds, peak = run_measured(make(dst))
            cpu = _children_cpu() - cpu
            written = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())
            print(f"round {round_ + 1}: {name:<28} {seconds:6.1f} s wall {cpu:6.1f} s CPU  peak "
                  f"{peak / 2**20:6.0f} MiB  wrote {written / GB:.2f} GB  (load average {os.getloadavg()[0]:.1f})",
                  flush=True)
            old = best.get(name, (float("inf"), 0, 0, float("inf")))
            best[name] = (min(old[0], seconds), max(old[1], peak), written, min(old[3], cpu))
            shutil.rmtree(dst, ignore_errors=True)
    read = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    cp_time = best["cp + sync"][0]
    print(f"\nscaled-down DeepSeek-V3 (FP8 release layout): {read / GB:.2f} GB read")
    print(f"{'variant':<28} {'best wall':>10} {'vs cp':>7} {'best CPU':>9} {'GB/CPU-s (in+out)':>18} "
          f"{'peak RssAnon+Shmem':>19}")
    for name, (seconds, peak, written, cpu) in best.items():
        moved = read + written
        print(f"{name:<28} {seconds:9.1f}s {seconds / cp_time:6.2f}x {cpu:8.1f}s {moved / max(cpu, 1e-3) / GB:18.3f} "
              f"{peak / 2**20:15.0f} MiB")
    full = hf_deepseek.config_from_hf(DEEPSEEK_V3, "DeepSeek-V3")
    full_read = sum(nbytes(e.shape, e.dtype) for e in hf_entries(full))
    full_ir = sum(nbytes(s) for s in expected_shapes(full).values())
    seconds, _, written, cpu = best["FP8 HF -> core torch_dist"]
    rate = (read + written) / cpu
    print(f"\nat the measured FP8 -> torch_dist CPU rate ({rate / GB:.3f} GB in+out per CPU second; this 2-core "
          f"machine is shared, so wall times above carry its load), the 671B release ({full_read / GB:.0f} GB -> "
          f"{full_ir / GB:.0f} GB) needs {(full_read + full_ir) / rate / 3600:.1f} CPU hours, about that wall time "
          "in one process on an unloaded core (the disk-bound floor is in `plan`)")
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dist, ignore_errors=True)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--disk-gbps", type=float, nargs="+", default=[1.0, 2.0, 5.0])
    for name, default in (("tp", 1), ("pp", 16), ("ep", 8), ("etp", 1), ("first", 4), ("last", 1)):
        p.add_argument(f"--{name}", type=int, default=default)  # 4 + 14 x 4 + 1 = 61 layers on 16 stages
    m = sub.add_parser("measure")
    m.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "out")
    m.add_argument("--repeat", type=int, default=2)
    m.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    plan(args) if args.command == "plan" else measure(args)


if __name__ == "__main__":
    main()
