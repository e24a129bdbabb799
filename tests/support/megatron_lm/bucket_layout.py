"""Megatron-LM 0.19's own grad-buffer layout for the distributed optimizer, for parameters of given sizes.

    python tests/support/megatron_lm/bucket_layout.py SPEC_JSON

SPEC_JSON is a list of {"params": [[numel, shared_embedding], ...] (named_parameters() order), "bucket_size": int
or null, "dp": data-parallel size}. Prints a JSON list of {"params": [[start, end, bucket], ...] (in the given
order), "buckets": [[start, end], ...], "unpadded": [numel_unpadded per bucket]}: what
DistributedOptimizer._compute_per_buffer_param_layout, which DDP builds its buffers from, gives for each. Needs no
process group. Runs in the megatron-core 0.19 environment.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch


def main(spec_json: str) -> None:
    print(json.dumps([layout(spec) for spec in json.loads(spec_json)]))


def layout(spec: dict) -> dict:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    params = []
    for numel, shared in spec["params"]:
        p = torch.nn.Parameter(torch.empty(numel))
        if shared:
            p.shared_embedding = True
        params.append(p)
    found = DistributedOptimizer._compute_per_buffer_param_layout(
        params, spec["bucket_size"], spec["dp"], SimpleNamespace(pad_buckets_for_high_nccl_busbw=False))
    return {"params": [list(found.param_index_map[p]) for p in params],
            "buckets": [list(b) for b in found.bucket_indices],
            "unpadded": list(found.per_bucket_numel_unpadded)}


if __name__ == "__main__":
    main(*sys.argv[1:])
