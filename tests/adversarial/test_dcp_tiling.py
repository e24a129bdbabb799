"""DCP chunks that do not tile their tensor: two chunks overlapping by a row while another row is left uncovered
add up to the right element count, and the uncovered row would be read from uninitialized memory. One check
(mconvert.io.dcp.check_tiling) refuses them in mconvert's DCP reader and in mtrain's resume alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from mconvert.errors import ConvertError
from mconvert.io.dcp import check_tiling
from mtrain import safe_dcp
from tests.adversarial.crafting import read_metadata_trusted, write_metadata
from tests.support.cli import run_cli
from tests.support.refusals import convert_refused, fresh, resume_refused

SHAPE = (6, 4)


@pytest.mark.parametrize("chunks", [
    [((0, 0), (6, 4))],
    [((0, 0), (3, 4)), ((3, 0), (3, 4))],
    [((0, 0), (3, 2)), ((0, 2), (3, 2)), ((3, 0), (3, 2)), ((3, 2), (3, 2))],  # a 2x2 grid
    [((0, 0), (6, 4)), ((6, 0), (0, 4))],  # an empty chunk at the end
], ids=["whole", "rows", "grid", "with an empty chunk"])
def test_chunks_that_tile_pass(chunks):
    check_tiling(Path("ckpt"), "w", SHAPE, chunks)


@pytest.mark.parametrize("chunks, message", [
    ([((0, 0), (4, 4)), ((3, 0), (2, 4))], "overlap"),  # rows 3 twice, row 5 nowhere: 24 elements all the same
    ([((0, 0), (3, 2)), ((0, 2), (3, 2)), ((3, 0), (3, 2)), ((2, 2), (3, 2))], "overlap"),  # a grid cell shifted
    ([((0, 0), (3, 4)), ((4, 0), (2, 4))], "hold 20 of its 24 elements"),  # row 3 missing
    ([((0, 0), (3, 4)), ((3, 0), (4, 4))], "does not fit"),  # past the last row
    ([((0,), (24,))], "does not fit"),  # another rank
], ids=["overlapping rows", "overlapping grid cells", "a row missing", "outside", "wrong rank"])
def test_chunks_that_do_not_tile_are_refused(chunks, message):
    with pytest.raises(ConvertError, match=message) as e:
        check_tiling(Path("ckpt"), "w", SHAPE, chunks)
    assert "ckpt" in str(e.value) and " w " in str(e.value)


def _overlap_rows(root: Path, fqn: str | None = None) -> str:
    """Rewrite a 2-D tensor stored as one chunk (`fqn`, else the first) as two chunks over rows [0, n/2+1) and
    [n/2, n-1): one row twice, the last row nowhere, the element count unchanged. Both records point at the
    original chunk's bytes (the check must refuse before any byte is read). Returns the tensor's name."""
    md = read_metadata_trusted(root)
    if fqn is None:
        fqn = next(k for k, v in md.state_dict_metadata.items()
                   if type(v).__name__ == "TensorStorageMetadata" and len(v.size) == 2 and len(v.chunks) == 1
                   and v.size[0] >= 4)
    meta = md.state_dict_metadata[fqn]
    rows, cols = meta.size
    index = next(k for k in md.storage_data if k.fqn == fqn)
    info = md.storage_data.pop(index)
    half = rows // 2
    meta.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([half + 1, cols])),
                   ChunkStorageMetadata(torch.Size([half, 0]), torch.Size([rows - half - 1, cols]))]
    for c in meta.chunks:
        md.storage_data[MetadataIndex(fqn, c.offsets)] = info
    write_metadata(root, md)
    return fqn


@pytest.fixture(scope="module")
def dcp_source(tmp_path_factory, llama_dir) -> Path:
    out = tmp_path_factory.mktemp("tiling") / "torch_dcp"
    run_cli("--saver", "core", "--ckpt-format", "torch_dcp", "--load-dir", llama_dir, "--save-dir", out, "-q")
    return out


def test_mconvert_refuses_overlapping_chunks(dcp_source, tmp_path):
    src = fresh(dcp_source, tmp_path)
    fqn = _overlap_rows(next(src.glob("iter_*")))
    convert_refused(src, tmp_path, saver="llama_mistral", culprits=(fqn, "overlap"))


def test_mtrain_resume_refuses_overlapping_chunks(mtrain_run, tmp_path):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    fqn = _overlap_rows(run / "step_0000002", "model.embed.weight")
    resume_refused(mtrain_run, run, tmp_path, "cannot resume from checkpoint step_0000002", fqn, "overlap")


def test_the_resume_planner_checks_the_records_it_plans_with(mtrain_run, tmp_path):
    """mtrain's reader re-reads .metadata for DCP's planner after its first check: the records the load is
    planned from are checked too (a file changed in between is refused, not trusted)."""
    run = fresh(mtrain_run["run"], tmp_path, "run")
    reader = safe_dcp.SafeReader(run / "step_0000002")
    _overlap_rows(run / "step_0000002", "model.embed.weight")
    with pytest.raises(ConvertError, match="model.embed.weight overlap"):
        reader.read_metadata()
