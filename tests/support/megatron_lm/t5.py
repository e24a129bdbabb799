"""Megatron T5 with megatron-core's own T5Model on one CPU process: write checkpoints with Megatron-LM 0.19's
`save_checkpoint`, load them with its `load_checkpoint` (or, in megatron-core 0.16.1, which has no training
package, straight into a T5Model built from the stored args), and record the logits.

    python tests/support/megatron_lm/t5.py save OUT_DIR SPEC_JSON     (0.19) [{"name", "flags"}] -> OUT_DIR/<name>
    python tests/support/megatron_lm/t5.py load SPEC_JSON             (0.19) [{"load", "out"}]
    python tests/support/megatron_lm/t5.py load_tp SPEC_JSON          (0.19) {"load", "out", "tp"}: one process per rank
    python tests/support/megatron_lm/t5.py core016 SPEC_JSON          (0.16) [{"file", "out"}]

The model is what Megatron-LM's pretrain_t5.py builds with the local spec (T5Model, encoder and decoder blocks
of `get_t5_encoder/decoder_with_local_block_spec`), except for the blocks' final norm: that spec names
Transformer Engine's TENorm, which is None without Transformer Engine; a torch LayerNorm (the local spec's own
LNImpl) stands in for it, holding the same `final_layernorm.weight` / `.bias` a Transformer Engine run saves.
Every OUT file holds {"enc", "dec"} tokens; "logits" [b, s_dec, padded vocabulary] are added to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import cpu  # noqa: E402


def block_specs(encoder_layers: int, decoder_layers: int):
    from megatron.core.models.T5 import t5_spec

    encoder = t5_spec.get_t5_encoder_with_local_block_spec(encoder_layers)
    decoder = t5_spec.get_t5_decoder_with_local_block_spec(decoder_layers)
    encoder.layer_norm = decoder.layer_norm = t5_spec.LNImpl  # see the module docstring
    return encoder, decoder


def build(config, encoder_layers: int, vocab: int, max_positions: int, tied: bool):
    import copy

    from megatron.core.models.T5 import T5Model

    encoder_config = copy.deepcopy(config)
    encoder_config.num_layers = encoder_layers
    encoder, decoder = block_specs(encoder_layers, config.num_layers)
    return T5Model(config=config, encoder_config=encoder_config, transformer_encoder_layer_spec=encoder,
                   transformer_decoder_layer_spec=decoder, vocab_size=vocab, max_sequence_length=max_positions,
                   parallel_output=True, share_embeddings_and_output_weights=tied,
                   position_embedding_type="learned_absolute")


def build_from_args(args):
    from megatron.training.arguments import core_transformer_config_from_args

    return build(core_transformer_config_from_args(args), args.encoder_num_layers, args.padded_vocab_size,
                 args.max_position_embeddings, not args.untie_embeddings_and_output_weights)


def logits(model, enc: torch.Tensor, dec: torch.Tensor) -> torch.Tensor:
    """T5Model's forward in eval mode: boolean masks (True = masked out), the decoder's causal."""
    b, s, t = enc.shape[0], enc.shape[1], dec.shape[1]
    enc_mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
    dec_mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1).expand(b, 1, t, t)
    enc_dec_mask = torch.zeros(b, 1, t, s, dtype=torch.bool)
    with torch.no_grad():
        return model.eval()(enc, dec, enc_mask, dec_mask, enc_dec_mask).float()


def tokens(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"enc": torch.randint(0, vocab, (2, 20), generator=g), "dec": torch.randint(0, vocab, (2, 12), generator=g)}


def save(out: str, spec_json: str) -> None:
    from megatron.core import parallel_state
    from megatron.training import checkpointing, global_vars
    from save import randomize_norms

    root = Path(out)
    for spec in json.loads(spec_json):
        flags = [*spec["flags"], "--save", str(root / spec["name"]), "--save-interval", "1", "--train-iters", "3"]
        args = cpu.megatron_args(flags)
        cpu.init_parallel(args)
        model = build_from_args(args)
        randomize_norms(model, seed=len(spec["name"]))
        checkpointing.save_checkpoint(3, [model], None, None, 0)
        record = tokens(spec["vocab"])
        record["logits"] = logits(model, record["enc"], record["dec"])
        torch.save(record, root / f"{spec['name']}.pt")
        parallel_state.destroy_model_parallel()
        global_vars.unset_global_variables()
        print(f"saved {spec['name']}", flush=True)


def load(spec_json: str) -> None:
    from megatron.core import parallel_state
    from megatron.training import checkpointing, global_vars

    for spec in json.loads(spec_json):
        args = cpu.megatron_args(["--load", spec["load"], "--use-checkpoint-args", "--no-load-optim",
                                  "--no-load-rng", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                                  str(spec["vocab"])])
        cpu.init_parallel(args)
        model = build_from_args(args)
        iteration, _ = checkpointing.load_checkpoint([model], None, None, strict=True)
        record = torch.load(spec["out"])
        record["logits"] = logits(model, record["enc"], record["dec"])
        record["iteration"] = iteration
        torch.save(record, spec["out"])
        parallel_state.destroy_model_parallel()
        global_vars.unset_global_variables()
        print(f"loaded {spec['load']} (iteration {iteration})", flush=True)


def load_tp(spec_json: str) -> None:
    """`load` at the checkpoint's own tensor-parallel size: one process per TP rank (gloo, spawned here), each
    loading its own rank file through Megatron-LM's load_checkpoint; the vocabulary-parallel logits are gathered
    and rank 0 writes them."""
    import socket

    import torch.multiprocessing as mp

    spec = json.loads(spec_json)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_load_rank, args=(spec, port), nprocs=spec["tp"], join=True)


def _load_rank(rank: int, spec: dict, port: int) -> None:
    import os

    from megatron.training import checkpointing

    os.environ |= {"RANK": str(rank), "WORLD_SIZE": str(spec["tp"]), "LOCAL_RANK": str(rank),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    cpu.patch_cuda()
    from megatron.training import arguments

    arguments.get_device_arch_version = lambda: 10  # TP > 1 asks the GPU's generation (for a CUDA setting only)
    torch.distributed.init_process_group(backend="gloo", rank=rank, world_size=spec["tp"])
    args = cpu.megatron_args(["--load", spec["load"], "--use-checkpoint-args", "--no-load-optim", "--no-load-rng",
                              "--tokenizer-type", "NullTokenizer", "--vocab-size", str(spec["vocab"]),
                              "--tensor-model-parallel-size", str(spec["tp"])])
    cpu.init_parallel(args)
    model = build_from_args(args)
    checkpointing.load_checkpoint([model], None, None, strict=True)
    record = torch.load(spec["out"])
    local = logits(model, record["enc"], record["dec"]).contiguous()  # [b, t, V_pad / tp]
    pieces = [torch.empty_like(local) for _ in range(spec["tp"])]
    torch.distributed.all_gather(pieces, local)
    if rank == 0:
        record["logits"] = torch.cat(pieces, dim=-1)
        torch.save(record, spec["out"])
        print(f"loaded {spec['load']} at TP {spec['tp']}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def core016(spec_json: str) -> None:
    """megatron-core 0.16.1 (no Megatron-LM training package): a T5Model built from the args stored in a
    TP 1, PP 1 `torch` rank file, its `model` entry loaded strictly."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.serialization.add_safe_globals([argparse.Namespace])
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # eval: no dropout
    for spec in json.loads(spec_json):
        state = torch.load(spec["file"], weights_only=True)
        a = state["args"]
        config = TransformerConfig(
            num_layers=a.decoder_num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
            num_attention_heads=a.num_attention_heads, kv_channels=a.kv_channels, layernorm_epsilon=a.norm_epsilon,
            add_bias_linear=a.add_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
            bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
            attention_backend="unfused", activation_func=torch.nn.functional.gelu)
        model = build(config, a.encoder_num_layers, a.padded_vocab_size, a.max_position_embeddings,
                      not a.untie_embeddings_and_output_weights)
        model.load_state_dict(state["model"], strict=True)
        record = torch.load(spec["out"])
        record["logits"] = logits(model, record["enc"], record["dec"])
        torch.save(record, spec["out"])
        print(f"ran {spec['file']}", flush=True)


def main(command: str, *rest: str) -> None:
    if command == "load_tp":  # each spawned rank starts its own process group
        return load_tp(*rest)
    if command == "core016":  # no megatron.training to patch: the CUDA stand-ins alone
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
        torch.cuda.set_rng_state = lambda *a, **k: None
    else:
        cpu.patch_cuda()
    cpu.start_process_group()
    {"save": save, "load": load, "core016": core016}[command](*rest)


if __name__ == "__main__":
    main(*sys.argv[1:])
