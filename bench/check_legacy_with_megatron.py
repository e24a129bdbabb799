"""Independent check: Megatron-LM's own legacy GPTModel loads a legacy checkpoint we wrote and computes the logits
transformers computes on the HF source. Not part of the test suite (needs a Megatron-LM tree with
`megatron/legacy`, i.e. at or before fd443f26ab, plus `omegaconf` and `einops`).

    mconvert --saver legacy --load-dir HF_DIR --save-dir OUT
    PYTHONPATH=MEGATRON_LM:EXTRA_SITE python bench/check_legacy_with_megatron.py OUT HF_DIR [megatron flags...]

Flags Megatron does not restore from a checkpoint's args must be given as they were in training, e.g.
`--openai-gelu` for GPT-2's gelu_new and `--no-rope-fusion` on CPU for RoPE models. Megatron reads the args
with its own `load_args_from_checkpoint` and the weights with `load_checkpoint(strict=True)`, on one CPU
process (TP 1, PP 1). Three CUDA-only spots are bypassed without touching any weight: the tracker all-reduce,
the CUDA RNG fork around dropout (eval mode: no dropout) and Apex's fused LayerNorm kernel (plain torch LayerNorm).
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
import warnings

import torch


def main(ckpt: str, hf_dir: str, flags: list[str]) -> None:
    warnings.filterwarnings("ignore")
    torch.cuda.current_device = lambda: "cpu"
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.distributed.init_process_group(backend="gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    import megatron.training.checkpointing as checkpointing
    from megatron.core.enums import ModelType
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    def read_metadata(tracker):  # same parsing as Megatron's, without its CUDA all-reduce
        text = open(tracker).read().strip()
        return (0, True) if text == "release" else (int(text), False)

    checkpointing.read_metadata = read_metadata
    sys.argv = ["check", "--use-cpu-initialization", "--micro-batch-size", "1", "--no-load-optim", "--no-load-rng",
                "--mock-data", "--no-initialization", "--load", ckpt, "--use-mp-args-from-checkpoint-args",
                "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                "--no-gradient-accumulation-fusion", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1",
                "--ckpt-format", "torch", "--use-legacy-models", "--transformer-impl", "local",
                "--attention-softmax-in-fp32", "--no-one-logger", *flags]
    margs, _ = checkpointing.load_args_from_checkpoint(parse_args())
    margs.world_size = 1
    margs = validate_args(margs)
    margs.model_type = ModelType.encoder_or_decoder
    margs.exit_on_missing_checkpoint = True
    set_global_variables(margs, build_tokenizer=False)

    sys.modules["fused_layer_norm_cuda"] = types.ModuleType("fused_layer_norm_cuda")
    import megatron.legacy.model.fused_layer_norm as fused

    fused.fused_layer_norm_affine = lambda x, w, b, shape, eps: torch.nn.functional.layer_norm(x, shape, w, b, eps)
    from megatron.legacy.model import GPTModel

    model = GPTModel(core_transformer_config_from_args(margs), num_tokentypes=0, parallel_output=False,
                     pre_process=True, post_process=True)
    iteration, _ = checkpointing.load_checkpoint([model], None, None, strict=True)
    model.eval()
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    vocab = reference.config.vocab_size
    # the legacy model builds rotary tables for exactly seq_length positions: feed full sequences
    tokens = torch.randint(0, vocab, (2, margs.seq_length), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    mask = torch.tril(torch.ones(1, 1, tokens.shape[1], tokens.shape[1])) < 0.5
    with torch.no_grad():
        want = reference(tokens).logits
        got = model(tokens, positions, mask)[..., :vocab]
    diff = (got - want).abs().max().item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"Megatron loaded {ckpt} (iteration {iteration}, padded vocab {margs.padded_vocab_size}) strictly; "
          f"max |logit diff| vs transformers {diff:.3g}, argmax agreement {agree:.0%}")
    if diff > 1e-4 or agree < 1.0:
        raise SystemExit("MISMATCH")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
