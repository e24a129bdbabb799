"""Load checkpoints with Megatron-LM 0.19's own code, as a user resuming from them would, and run them.

    python tests/support/megatron_lm/load.py SPEC_JSON

SPEC_JSON is a list of {"load": CHECKPOINT_DIR, "flags": [...], "out": FILE, "fsdp": bool}. For each, Megatron
parses its arguments with `--use-checkpoint-args` (parse_and_validate_args: the model shape, tokenizer_type and
tokenizer_model come from the checkpoint's args, and the tokenizer is built from them), builds the GPTModel
those args describe, loads the weights, and runs it on the tokens in OUT (a torch file holding {"tokens"}),
adding "logits" (over the padded vocabulary) and "args" (what Megatron ended up with) to it.

How the weights are loaded depends on the format Megatron detects:
- torch, torch_dist: `load_checkpoint(strict=True)`; torch_dist also through `dist_checkpointing.load` into a
  second model's sharded state dict, which must give the same tensors;
- fsdp_dtensor ("fsdp": true; Megatron tells it from torch_dcp by the run's --use-megatron-fsdp):
  `load_checkpoint` as a Megatron-FSDP run does (ckpt_format fsdp_dtensor, the model nested as
  Megatron-FSDP nests it), with the one
  FSDP-only step, splitting the fc1 parameter into its `_w`/`_v` halves, done on the plain parameter (views of
  rows [:n/2] and [n/2:], which is what that step yields on one rank);
- torch_dcp: Megatron's torch_dcp loader also requires optimizer, scheduler and RNG state, which a converted
  checkpoint has none of; the model part of it, `torch.distributed.checkpoint.load({"model":
  model.state_dict()})`, is what runs here.
Runs in the megatron-core 0.19 environment (scripts/megatron_envs.sh).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import cpu  # noqa: E402


def split_fc1_views(model, model_state_dict, optimizer_state_dict):
    """One rank's result of Megatron's handle_swiglu_in_state_dict: fc1 [w; v] as two views `_w`, `_v`."""
    out = {}
    for key, value in model_state_dict.items():
        if ".linear_fc1.weight" in key or ".linear_fc1.bias" in key:
            out[f"{key}_w"], out[f"{key}_v"] = torch.chunk(value, 2, dim=0)
        else:
            out[key] = value
    return out, optimizer_state_dict


def load_one(spec: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.training import checkpointing, global_vars

    flags = ["--load", spec["load"], "--use-checkpoint-args", "--no-load-optim", "--no-load-rng", *spec["flags"]]
    args = cpu.megatron_args(flags)
    it_dir = Path(checkpointing.get_checkpoint_name(spec["load"], args.iteration, return_base_dir=True))
    fmt = checkpointing._get_checkpoint_format(str(it_dir), args)  # what Megatron detects from the files
    if fmt == "torch_dcp" and spec.get("fsdp"):  # Megatron tells the two apart by the run's --use-megatron-fsdp
        fmt = "fsdp_dtensor"
    cpu.init_parallel(args)
    model = cpu.build_model(args)
    if fmt in ("torch", "torch_dist"):
        iteration, _ = checkpointing.load_checkpoint([model], None, None, strict=True)
    elif fmt == "fsdp_dtensor":
        args.use_megatron_fsdp, args.ckpt_format = True, fmt  # a Megatron-FSDP run (flags validated without it)
        checkpointing.handle_swiglu_in_state_dict = split_fc1_views
        checkpointing.preprocess_state_dict_for_uneven_dtensor = lambda state_dict: None
        iteration, _ = checkpointing.load_checkpoint([cpu.fsdp_shaped(model)], None, None, strict=True)
    else:
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(it_dir))
        model.load_state_dict(state["model"], strict=True)
        iteration = args.iteration
    if fmt == "torch_dist":  # megatron-core's own reader, straight into a fresh model's sharded state dict
        other = cpu.build_model(args)
        loaded = dist_checkpointing.load(other.sharded_state_dict(), str(it_dir))
        mine = model.state_dict()
        for key, value in loaded.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, mine[key]), f"dist_checkpointing.load and load_checkpoint differ: {key}"
    record = torch.load(spec["out"])
    record["logits"] = cpu.logits(model, record["tokens"])
    record["args"] = {"ckpt_format": fmt, "iteration": iteration, "tokenizer_type": args.tokenizer_type,
                      "tokenizer_model": args.tokenizer_model, "padded_vocab_size": args.padded_vocab_size,
                      "num_layers": args.num_layers, "num_experts": args.num_experts}
    torch.save(record, spec["out"])
    parallel_state.destroy_model_parallel()
    global_vars.unset_global_variables()
    print(f"loaded {spec['load']} ({fmt}, iteration {iteration})", flush=True)


def main(spec_json: str) -> None:
    cpu.patch_cuda()
    cpu.start_process_group()
    for spec in json.loads(spec_json):
        load_one(spec)


if __name__ == "__main__":
    main(*sys.argv[1:])
