"""Run under torchrun (gloo): load a torch_dist checkpoint with megatron-core's own dist_checkpointing into a
GPTModel's sharded state dict at TP = world size, and compare every tensor with a Megatron-written `torch`
checkpoint of the same model (the fixtures), rank by rank. Prints one line `OK <n>` or raises.

    torchrun --nproc-per-node TP tests/support/scripts/mcore_load.py CKPT_ITER_DIR REFERENCE_DIR

Runs in a megatron-core environment (scripts/megatron_envs.sh); needs nothing from this repository.
"""

import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def main() -> None:
    ckpt, reference = sys.argv[1], sys.argv[2]
    # Megatron's modules (and torch.distributed.checkpoint with them) before the group: imported after, they keep
    # it alive past destroy_process_group (see mconvert.workers.init_process_group).
    from megatron.core import dist_checkpointing, parallel_state  # registers Megatron's classes for weights_only

    dist.init_process_group("gloo")

    def safe_load(path):
        return torch.load(path, map_location="cpu", weights_only=True)

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp, rank = dist.get_world_size(), dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    def rank_file(pp: int) -> str:
        stage = f"_{pp:03d}" if args.pipeline_model_parallel_size > 1 else ""
        return f"{reference}/iter_0000001/mp_rank_{rank:02d}{stage}/model_optim_rng.pt"

    args = safe_load(next(__import__("pathlib").Path(reference).glob("iter_*/mp_rank_*/*.pt")))["args"]
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, layernorm_epsilon=args.layernorm_epsilon, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, tensor_model_parallel_size=tp)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt)

    # A pipelined reference stores global layers p*L/P .. of stage p with local numbers.
    per_stage = args.num_layers // args.pipeline_model_parallel_size
    want = {}
    for pp in range(args.pipeline_model_parallel_size):
        state = safe_load(rank_file(pp))["model"]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                if key.startswith("decoder.layers."):
                    _, _, local, rest = key.split(".", 3)
                    key = f"decoder.layers.{int(local) + pp * per_stage}.{rest}"
                want[key] = value
    got = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad
    assert loaded["checkpoint_version"] == 3.0 and loaded["args"].num_layers == args.num_layers
    print(f"OK {len(got)}", flush=True)
    del loaded, got
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


main()
