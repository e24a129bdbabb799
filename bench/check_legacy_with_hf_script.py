"""Independent check: transformers' own Megatron -> HF GPT-2 converter reads a legacy checkpoint we wrote back into
the HF source's tensors. Not part of the test suite (needs the script, which transformers 5.14.1 still ships:
`transformers/models/megatron_gpt2/checkpoint_reshaping_and_interoperability.py`).

    mconvert --saver legacy --tp 2 --pp 2 --load-dir HF_DIR --save-dir OUT
    python bench/check_legacy_with_hf_script.py SCRIPT OUT/iter_0000001 HF_DIR

Two things are worked around, neither touching the checkpoint: the script loads with weights_only=True, which
refuses argparse.Namespace unless registered as a safe global (Megatron registers it when imported), and its save
step fails on any input (it indexes the Megatron state dict with HF names), so the converted state dict is taken
where the script hands it to `split_torch_state_dict_into_shards`.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import tempfile
from pathlib import Path

import huggingface_hub
import torch
from safetensors.torch import load_file
from transformers import GPT2Config


class _Captured(Exception):
    pass


def main(script: str, load_path: str, hf_dir: str) -> None:
    torch.serialization.add_safe_globals([argparse.Namespace])
    captured: dict[str, torch.Tensor] = {}

    def capture(state_dict, **kwargs):
        captured.update(state_dict)
        raise _Captured

    huggingface_hub.split_torch_state_dict_into_shards = capture
    out = tempfile.mkdtemp()
    sys.argv = [script, "--convert_checkpoint_from_megatron_to_transformers", "--load_path", load_path,
                "--save_path", out, "--tokenizer_name", hf_dir]
    try:
        runpy.run_path(script, run_name="__main__")
    except _Captured:
        pass
    want = load_file(Path(hf_dir) / "model.safetensors")
    got = {k: v for k, v in captured.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    got.pop("lm_head.weight")  # their tied copy of wte
    same_keys = sorted(got) == sorted(want)
    differ = [k for k in want if k in got and not torch.equal(got[k], want[k])]
    config = GPT2Config.from_pretrained(out)
    source = json.loads((Path(hf_dir) / "config.json").read_text())
    sizes = {k: getattr(config, k) for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head",
                                             "activation_function")}
    print(f"keys equal: {same_keys}; tensors that differ: {differ}; their config {sizes}, n_inner {config.n_inner}")
    if not same_keys or differ or any(source.get(k, v) != v for k, v in sizes.items()):
        raise SystemExit("MISMATCH")


if __name__ == "__main__":
    main(*sys.argv[1:4])
