"""Megatron-LM 0.19 resumes from what we write: `--use-checkpoint-args` rebuilds the model from our args (shape,
tokenizer), its own loaders read the weights (load_checkpoint; dist_checkpointing.load too; --verify-integrity
checks our manifest), and its forward pass gives transformers' logits. See tests/support/megatron_lm/load.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.support.cli import run_cli, run_megatron
from tests.support.compare import hf_logits

# (family, format, Megatron flags a resuming run must give itself: args Megatron does not take from a checkpoint)
CASES = {
    "llama-torch": ("llama", "torch", []),
    "llama-torch_dist": ("llama", "torch_dist", ["--verify-integrity"]),
    "llama-fsdp_dtensor": ("llama", "fsdp_dtensor", []),
    "llama-torch_dcp": ("llama", "torch_dcp", []),
    "mixtral-torch": ("mixtral", "torch", []),
    "mixtral-torch_dist": ("mixtral", "torch_dist", ["--verify-integrity"]),
    "mixtral-fsdp_dtensor": ("mixtral", "fsdp_dtensor", []),
    "gpt2-torch": ("gpt2", "torch", ["--openai-gelu"]),  # tanh GELU: --openai-gelu is not restored from args
    "gpt2-torch_dist": ("gpt2", "torch_dist", ["--openai-gelu", "--verify-integrity"]),
    # no tokenizer carried: none in args, the run names its own
    "llama-torch_dist-no-tokenizer": ("llama", "torch_dist",
                                      ["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]),
    # written without integrity.json: Megatron loads it when not asked to verify it
    "llama-torch_dist-no-manifest": ("llama", "torch_dist", []),
}
CONVERT_FLAGS = {"llama-torch_dist-no-manifest": ["--no-integrity-manifest"]}  # ours, beside --ckpt-format


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, mcore_python, llama_dir, mixtral_dir, gpt2_dir, tokens):
    """Every case converted by us and loaded by Megatron-LM 0.19 in one process: case -> (record, source, dir)."""
    python = mcore_python("0.19")
    root = tmp_path_factory.mktemp("ours_in_megatron019")
    sources = {"llama": llama_dir, "mixtral": mixtral_dir, "gpt2": gpt2_dir}
    bare = root / "llama_without_tokenizer"
    shutil.copytree(llama_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    specs, out = [], {}
    for case, (family, fmt, flags) in CASES.items():
        src = bare if case.endswith("no-tokenizer") else sources[family]
        run_cli("--saver", "core", "--ckpt-format", fmt, *CONVERT_FLAGS.get(case, []), "--load-dir", src,
                "--save-dir", root / case)
        record = root / f"{case}.pt"
        torch.save({"tokens": tokens}, record)
        specs.append({"load": str(root / case), "flags": flags, "out": str(record), "fsdp": fmt == "fsdp_dtensor"})
        out[case] = (record, src)
    stdout = run_megatron(python, "load.py", json.dumps(specs))
    assert sum(line.startswith("loaded ") for line in stdout.splitlines()) == len(CASES), stdout[-3000:]
    return {case: (torch.load(record), src, root / case) for case, (record, src) in out.items()}


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_megatron_019_resumes_from_our_checkpoint(case, loaded, tokens):
    record, src, ckpt = loaded[case]
    family, fmt, _ = CASES[case]
    args = record["args"]
    # mconvert pads nothing by default (300 = 4 x 75); --use-checkpoint-args restores padded_vocab_size, so
    # Megatron-LM builds the 300 rows stored (its own default divisor, 128, would have made 384)
    assert (args["ckpt_format"], args["iteration"], args["padded_vocab_size"]) == (fmt, 1, 300)
    assert args["num_experts"] == (4 if family == "mixtral" else None)
    if fmt == "torch_dist":  # with the manifest unless told otherwise (and then Megatron verified it: its flags)
        assert (ckpt / "iter_0000001" / "integrity.json").is_file() == (case not in CONVERT_FLAGS)
    if case.endswith("no-tokenizer"):
        assert args["tokenizer_type"] == "NullTokenizer" and args["tokenizer_model"] is None
    else:  # Megatron built its tokenizer from the one we carry, named in our args
        assert args["tokenizer_type"] == "HuggingFaceTokenizer"
        assert args["tokenizer_model"] == str((ckpt / "iter_0000001" / "tokenizer").resolve())
    # float32 against another implementation's float32, the same sums in other orders: logits of these tiny models
    # are below 1 and each implementation within ~4e-7 of float64's (measured for transformers), so they agree to
    # ~1e-6; 1e-5 leaves a factor 10, where a wrong tensor or setting moves logits by > 1e-3
    torch.testing.assert_close(record["logits"][..., :300], hf_logits(src, tokens), atol=1e-5, rtol=0)
