"""mconvert.io.dcp on its own: several ranks writing their own shards, partial reads without copies."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mconvert.errors import ConvertError
from mconvert.io.dcp import DcpReader
from mconvert.io.dcp_writer import DcpWriter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_as_rank(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    full = torch.arange(4 * 6 * 3, dtype=torch.float32).reshape(4, 6, 3)
    with DcpWriter(root, rank=rank) as writer:
        for layer in range(4):  # each rank writes its half of the rows of every layer
            rows = slice(rank * 3, rank * 3 + 3)
            writer.add_chunk("stack", (4, 6, 3), (layer, rank * 3, 0), full[layer:layer + 1, rows])
        writer.add_object(f"state/shard_{rank}_{world}", {"rank": rank})
        writer.finish()
    dist.destroy_process_group()


def test_ranks_write_their_own_shards(tmp_path):
    mp.spawn(_write_as_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    assert sorted(p.name for p in tmp_path.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp",
                                                                 "__1_1.distcp"]
    full = torch.arange(4 * 6 * 3, dtype=torch.float32).reshape(4, 6, 3)
    reader = DcpReader(tmp_path)
    assert torch.equal(reader.read("stack"), full)
    assert torch.equal(reader.read("stack", 2), full[2])
    assert reader.read_object("state/shard_1_2") == {"rank": 1}
    import torch.distributed.checkpoint as dcp

    state = {"stack": torch.empty(4, 6, 3)}
    dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(state["stack"], full)


def test_layer_slices_of_one_big_chunk_are_views_of_the_file(tmp_path):
    full = torch.randn(8, 16, 4)
    with DcpWriter(tmp_path) as writer:
        writer.add_chunk("stack", full.shape, (0, 0, 0), full)  # all layers in a single chunk
        writer.finish()
    reader = DcpReader(tmp_path)
    a, b = reader.read("stack", 3), reader.read("stack", 5)
    assert torch.equal(a, full[3]) and torch.equal(b, full[5])
    # both layers are windows on the same memory-mapped chunk: nothing was copied, nothing else was read
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert b.data_ptr() - a.data_ptr() == 2 * 16 * 4 * 4


def test_reading_needs_no_torch_distributed_checkpoint(tmp_path):
    """DCP metadata is read as plain records: torch.distributed.checkpoint (and its pickle) is never imported."""
    import subprocess
    import sys

    with DcpWriter(tmp_path) as writer:
        writer.add_chunk("w", (2, 3), (0, 0), torch.ones(2, 3))
        writer.finish()
    code = ("import sys, torch; from mconvert.io.dcp import DcpReader; "
            f"t = DcpReader(__import__('pathlib').Path(r'{tmp_path}')).read('w'); "
            "print(bool(torch.equal(t, torch.ones(2, 3))), 'torch.distributed.checkpoint' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


def test_ranges_of_a_flat_tensor_in_several_chunks(tmp_path):
    """read_range (the distributed optimizer's windows on its flat buckets): a window inside one chunk is a view
    of the file, one across chunks is copied from each, one past the end is refused by name."""
    flat = torch.arange(100, dtype=torch.float32)
    with DcpWriter(tmp_path) as writer:
        for start, stop in ((0, 30), (30, 64), (64, 100)):
            writer.add_chunk("bucket", (100,), (start,), flat[start:stop])
        writer.finish()
    reader = DcpReader(tmp_path)
    inside, again = reader.read_range("bucket", 35, 50), reader.read_range("bucket", 40, 64)
    assert torch.equal(inside, flat[35:50]) and torch.equal(again, flat[40:64])
    assert again.data_ptr() - inside.data_ptr() == 5 * 4  # windows on the same mapped chunk
    assert torch.equal(reader.read_range("bucket", 10, 90), flat[10:90])
    assert reader.read_range("bucket", 7, 7).numel() == 0
    with pytest.raises(ConvertError, match="bucket.*101"):
        reader.read_range("bucket", 90, 101)
