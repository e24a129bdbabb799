"""Write checkpoints with Megatron-LM 0.19's own `save_checkpoint`, and Megatron's logits for each.

    python tests/support/megatron_lm/save.py OUT_DIR SPEC_JSON

SPEC_JSON is a list of {"name", "flags"}: Megatron command-line flags for one tiny model (save format, shape,
tokenizer...), plus optional "singleton": true to save with the `singleton_local_shards` metadata Megatron-LM
used by default in autumn 2025 (per-layer keys, `_w`/`_v` SwiGLU halves; the code path still exists in 0.19).
Each model is built by Megatron with its own random initialization (norm weights and biases then randomized so
that a norm or bias mix-up changes the numbers), saved to OUT_DIR/<name> at iteration 3, and run on fixed tokens:
OUT_DIR/<name>.pt holds {"tokens", "logits"} (logits over the padded vocabulary).

`fsdp_dtensor` and `torch_dcp` need Megatron-FSDP / torch FSDP2 on GPUs to train; their checkpoints hold the
same global tensors whatever the data-parallel sharding, so here the model goes through `save_checkpoint` with
the format set after argument validation (for fsdp_dtensor nested as Megatron-FSDP nests it, cpu.fsdp_shaped),
and the one FSDP-only step on the way (the SwiGLU fc1 split, which reads FSDP's buffer slices) is replaced by its
one-rank result: rows [:n/2] and [n/2:].
Runs in the megatron-core 0.19 environment (scripts/megatron_envs.sh).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import cpu  # noqa: E402


def randomize_norms(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def swiglu_split_one_rank(model, model_state_dict, optimizer_state_dict):
    """What Megatron's handle_swiglu_in_state_dict yields on one rank: fc1 [w; v] split into `_w` and `_v`."""
    out = {}
    for key, value in model_state_dict.items():
        if (".mlp.linear_fc1." in key or ".linear_fc1.weight" in key or ".linear_fc1.bias" in key) and \
                isinstance(value, torch.Tensor) and not key.endswith("_extra_state"):
            out[f"{key}_w"], out[f"{key}_v"] = torch.chunk(value, 2, dim=0)
        else:
            out[key] = value
    return out, optimizer_state_dict


def save_one(root: Path, spec: dict) -> None:
    from megatron.core import parallel_state
    from megatron.training import checkpointing, global_vars

    flags = [*spec["flags"], "--save", str(root / spec["name"]), "--save-interval", "1", "--train-iters", "3"]
    fmt = flags[flags.index("--ckpt-format") + 1]
    if fmt in ("fsdp_dtensor", "torch_dcp"):  # validated as torch_dist, switched below (see the docstring)
        flags[flags.index("--ckpt-format") + 1] = "torch_dist"
    args = cpu.megatron_args(flags)
    args.ckpt_format = fmt
    cpu.init_parallel(args)
    if spec.get("singleton"):
        build = checkpointing._build_sharded_state_dict_metadata
        checkpointing._build_sharded_state_dict_metadata = \
            lambda *a, **k: build(*a, **k) | {"singleton_local_shards": True}
    if fmt == "fsdp_dtensor":
        checkpointing.handle_swiglu_in_state_dict = swiglu_split_one_rank
        checkpointing.preprocess_state_dict_for_uneven_dtensor = lambda state_dict: None
    model = cpu.build_model(args)
    randomize_norms(model, seed=len(spec["name"]))
    checkpointing.save_checkpoint(3, [cpu.fsdp_shaped(model) if fmt == "fsdp_dtensor" else model], None, None, 0)
    vocab = args.vocab_size or spec["vocab"]
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.save({"tokens": tokens, "logits": cpu.logits(model, tokens)}, root / f"{spec['name']}.pt")
    if spec.get("singleton"):
        checkpointing._build_sharded_state_dict_metadata = build
    parallel_state.destroy_model_parallel()
    global_vars.unset_global_variables()
    print(f"saved {spec['name']} ({fmt})", flush=True)


def main(out: str, spec_json: str) -> None:
    cpu.patch_cuda()
    cpu.start_process_group()
    root = Path(out)
    for spec in json.loads(spec_json):
        save_one(root, spec)


if __name__ == "__main__":  # the async checkpoint writer spawns processes that re-import this module
    main(*sys.argv[1:])
