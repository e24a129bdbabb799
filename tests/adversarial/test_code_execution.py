"""Code execution: a pickle that runs code, planted in every place any command unpickles from.

Each case asserts: the marker the payload would create never appears, the command exits non-zero with an
`Error:` naming the file (and the global it asked for, where the pickle says), and nothing is left behind.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from tests.adversarial.crafting import (
    PAYLOAD_NAMES,
    SHOWN,
    evil_archive,
    payloads,
    plant_bytes_item,
    plant_in_torch_file,
    plant_tensor_chunk,
    read_metadata_trusted,
    torch_bytes,
    write_metadata,
)
from tests.support.refusals import convert_refused, fresh, mtrain_cli, refused, resume_refused

ALL = PAYLOAD_NAMES
TWO = ("os.system", "builtins.exec")


@pytest.mark.parametrize("name", ALL)
def test_every_payload_is_live(name, marker):
    """The control: each payload does run under plain pickle and torch.load(weights_only=False)."""
    payload = payloads(marker)[name]
    pickle.loads(pickle.dumps(payload))
    assert marker.exists()
    marker.unlink()
    import io
    torch.load(io.BytesIO(torch_bytes({"args": payload})), weights_only=False)
    assert marker.exists()
    marker.unlink()


def _rank_file(root: Path) -> Path:
    return next(root.glob("iter_*/mp_rank_00*/model_optim_rng.pt"))


# -- mconvert: every loader ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("detect", [False, True], ids=["loader-core", "detected"])
def test_megatron_core_rank_file(sources, tmp_path, marker, name, detect):
    src = fresh(sources["core"], tmp_path)
    plant_in_torch_file(_rank_file(src), payloads(marker)[name], "args")
    extra = () if detect else ("--loader", "core")
    convert_refused(src, tmp_path, *extra, culprits=("model_optim_rng.pt", "refusing to unpickle", SHOWN[name]))


@pytest.mark.parametrize("name", TWO)
def test_megatron_legacy_rank_file(sources, tmp_path, marker, name):
    src = fresh(sources["legacy"], tmp_path)
    plant_in_torch_file(_rank_file(src), payloads(marker)[name], "args")
    convert_refused(src, tmp_path, "--loader", "legacy", culprits=("model_optim_rng.pt", SHOWN[name]))


@pytest.mark.parametrize("name", TWO)
@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_dist_common_pt(sources, tmp_path, marker, name, backend):
    src = fresh(sources[backend], tmp_path)
    plant_in_torch_file(next(src.glob("iter_*/common.pt")), payloads(marker)[name], "args")
    convert_refused(src, tmp_path, culprits=("common.pt", SHOWN[name]))


@pytest.mark.parametrize("name", TWO)
def test_dist_common_state_bytes_item(sources, tmp_path, marker, name):
    """Newer Megatron keeps the common state as a bytes item inside the DCP files instead of common.pt."""
    src = fresh(sources["torch_dist"], tmp_path)
    it_dir = next(src.glob("iter_*"))
    (it_dir / "common.pt").unlink()
    add_bytes_item(it_dir, "common_state/shard_0_1", torch_bytes([payloads(marker)[name]]))
    convert_refused(src, tmp_path, culprits=("common_state", SHOWN[name]))


@pytest.mark.parametrize("name", TWO)
def test_dcp_metadata(sources, tmp_path, marker, name):
    src = fresh(sources["torch_dist"], tmp_path)
    it_dir = next(src.glob("iter_*"))
    (it_dir / ".metadata").write_bytes(pickle.dumps(payloads(marker)[name], protocol=2))
    convert_refused(src, tmp_path, culprits=(".metadata", "refusing to unpickle"))


@pytest.mark.parametrize("name", TWO)
def test_dcp_tensor_chunk(sources, tmp_path, marker, name):
    src = fresh(sources["torch_dist"], tmp_path)
    plant_tensor_chunk(next(src.glob("iter_*")), evil_archive(payloads(marker)[name]))
    convert_refused(src, tmp_path, culprits=("unexpected global",))


@pytest.mark.parametrize("name", ALL)
def test_hf_pytorch_model_bin(sources, tmp_path, marker, name):
    src = fresh(sources["llama_bin"], tmp_path)
    plant_in_torch_file(src / "pytorch_model.bin", payloads(marker)[name], "model.embed_tokens.weight")
    convert_refused(src, tmp_path, culprits=("pytorch_model.bin", SHOWN[name]))


@pytest.mark.parametrize("name", TWO)
def test_hf_generic_loader(sources, tmp_path, marker, name):
    """`--loader hf` hands the directory to its family's loader: the same allow-list."""
    src = fresh(sources["llama_bin"], tmp_path)
    plant_in_torch_file(src / "pytorch_model.bin", payloads(marker)[name], "model.norm.weight")
    convert_refused(src, tmp_path, "--loader", "hf", culprits=("pytorch_model.bin", SHOWN[name]))


@pytest.mark.parametrize("name", TWO)
@pytest.mark.parametrize("family", ["gpt2_hf", "mixtral_hf"])
def test_hf_bin_of_other_families(sources, tmp_path, marker, name, family):
    src = fresh(sources[family], tmp_path)
    (src / "model.safetensors").unlink()
    torch.save({"lm_head.weight": payloads(marker)[name]}, src / "pytorch_model.bin")
    convert_refused(src, tmp_path, "--loader", family, culprits=("pytorch_model.bin", SHOWN[name]))


@pytest.mark.parametrize("name", TWO)
def test_meta_consolidated(tmp_path, marker, name):
    src = tmp_path / "meta"
    src.mkdir()
    (src / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 2, "n_heads": 8, "norm_eps": 1e-5}))
    torch.save({"tok_embeddings.weight": payloads(marker)[name]}, src / "consolidated.00.pth")
    convert_refused(src, tmp_path, culprits=("consolidated.00.pth", SHOWN[name]))


@pytest.mark.parametrize("name", TWO)
@pytest.mark.parametrize("where", ["metadata", "tensor chunk"])
def test_mtrain_export(mtrain_run, tmp_path, marker, name, where):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    step = run / "step_0000002"
    if where == "metadata":
        (step / ".metadata").write_bytes(pickle.dumps(payloads(marker)[name], protocol=2))
    else:
        plant_tensor_chunk(step, evil_archive(payloads(marker)[name]))
    convert_refused(run, tmp_path, saver="llama_mistral", culprits=("step_0000002",))


# -- mtrain: resume, finetune, evaluate ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("where", ["metadata", "optimizer bytes item"])
def test_mtrain_resume(mtrain_run, tmp_path, marker, name, where):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    step = run / "step_0000002"
    if where == "metadata":
        (step / ".metadata").write_bytes(pickle.dumps(payloads(marker)[name], protocol=2))
        resume_refused(mtrain_run, run, tmp_path, "step_0000002", "refusing to unpickle")
    else:
        fqn = plant_bytes_item(step, torch_bytes(payloads(marker)[name]))
        resume_refused(mtrain_run, run, tmp_path, "step_0000002", fqn, SHOWN[name])


@pytest.mark.parametrize("name", TWO)
@pytest.mark.parametrize("where", ["rng file", "tensor chunk"])
def test_mtrain_resume_rng_and_chunks(mtrain_run, tmp_path, marker, name, where):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    step = run / "step_0000002"
    if where == "rng file":
        torch.save({"torch": payloads(marker)[name]}, step / "rng" / "rank_00000.pt")
        resume_refused(mtrain_run, run, tmp_path, "step_0000002", "rank_00000.pt", SHOWN[name])
    else:
        plant_tensor_chunk(step, evil_archive(payloads(marker)[name]))
        resume_refused(mtrain_run, run, tmp_path, "step_0000002", "unexpected global")


@pytest.mark.parametrize("command", ["evaluate", "finetune"])
def test_mtrain_commands_reading_any_checkpoint(sources, mtrain_run, tmp_path, marker, command):
    src = fresh(sources["core"], tmp_path)
    plant_in_torch_file(_rank_file(src), payloads(marker)["os.system"], "args")
    if command == "evaluate":
        code, out = mtrain_cli("evaluate", "--load", src, "--data", mtrain_run["prefix"], "--seq-len", "16")
    else:
        code, out = mtrain_cli("finetune", "--load", src, "--checkpoint.dir", tmp_path / "ft",
                               "--data.paths", mtrain_run["prefix"], "--train.steps", "1")
        assert not (tmp_path / "ft").exists()
    assert code != 0
    refused(out, "model_optim_rng.pt", SHOWN["os.system"])


def add_bytes_item(root: Path, fqn: str, data: bytes) -> None:
    """Add a bytes item `fqn` holding `data` to a DCP directory (appended to one of its files)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    md = read_metadata_trusted(root)
    info = next(iter(md.storage_data.values()))
    with open(root / info.relative_path, "ab") as f:
        offset = f.tell()
        f.write(data)
    md.state_dict_metadata[fqn] = BytesStorageMetadata()
    md.storage_data[MetadataIndex(fqn)] = type(info)(relative_path=info.relative_path, offset=offset,
                                                     length=len(data))
    write_metadata(root, md)
