"""megatron-core's grad-buffer layout under the distributed optimizer, where its per-parameter state lives in flat
buffers (`torch` checkpoints' distrib_optim.pt, torch_dist's dp_reshardable and dp_zero_gather_scatter).

Megatron-LM 0.16-0.19 (DistributedOptimizer._compute_per_buffer_param_layout; 0.16 in its grad buffer): a model
chunk's parameters of one dtype in reverse named_parameters() order, each starting at a multiple of 64 elements;
a bucket closes once it reaches the bucket size (with --overlap-grad-reduce, in the first chunk of the first
pipeline stage only) and is padded at its end to a multiple of lcm(DP, 128); a tied embedding or output layer
shared between pipeline stages gets a bucket of its own. MoE models' expert-parallel parameters have buffers of
their own (DDP's expert_parallel_buffers), laid out the same way. Checkpoints store each bucket without that end
padding ("unpadded"), so offsets do not depend on the DP size. Checked against Megatron's own function by
tests/support/megatron_lm/bucket_layout.py.
"""

from __future__ import annotations


def bucket_offsets(params: list[tuple[str, int, bool]], bucket_size: int | None) -> tuple[dict[str, int], int]:
    """Where each parameter (key, numel, shared between stages) starts in a chunk's coalesced flat tensor, and
    its length: Megatron's grad-buffer layout with the distributed optimizer, without the padding after buckets
    (bucket ends are padded to multiples of 128, so offsets within a bucket keep their 64-alignment)."""
    offsets, done, start, members, end = {}, 0, 0, 0, 0
    for key, numel, shared in reversed(params):
        start = -(-start // 64) * 64
        if shared and members:
            done, start, members = done + start, 0, 0
        end = start + numel
        offsets[key] = done + start
        members += 1
        if (bucket_size is not None and end >= bucket_size) or shared:
            done, start, members = done + end, 0, 0
        else:
            start = end
    return offsets, done + (end if members else 0)


def bucket_size(args, first_chunk: bool = True, pp: int = 0) -> int | None:
    """The elements after which a bucket of a model chunk closes (None: one bucket per chunk), as megatron-core's
    DDP sizes them for the run these args describe (training.get_model): only the first chunk of the first
    pipeline stage is cut, and only with --overlap-grad-reduce and without
    --overlap-param-gather-with-optimizer-step."""
    if not getattr(args, "overlap_grad_reduce", False) or not first_chunk or pp > 0 or \
            getattr(args, "overlap_param_gather_with_optimizer_step", False):
        return None
    dp = int(getattr(args, "data_parallel_size", 1) or 1)
    return getattr(args, "ddp_bucket_size", None) or max(40_000_000, 1_000_000 * dp)


def shared(key: str, *, tied: bool, pp: int, stages: int) -> bool:
    """Megatron marks a tied embedding `shared_embedding` when the first and last stage are different ranks."""
    first = pp == 0 and key == "embedding.word_embeddings.weight"
    last = pp == stages - 1 and key == "output_layer.weight"
    return tied and stages > 1 and (first or last)
