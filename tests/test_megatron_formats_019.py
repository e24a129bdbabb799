"""The formats current Megatron-LM writes, without Megatron: the fsdp_dtensor and torch_dcp layouts (their round
trips are tests/conversion/test_roundtrip.py), the single grouped expert weight, integrity.json on our output, the
pickle allow-list for newer megatron-core."""

from __future__ import annotations

import json
import pickle
import zipfile

import pytest
import torch

from mconvert.io.dcp import DcpReader, read_metadata
from mconvert.io.torch_pickle import safe_load
from tests.support.cli import run_cli
from tests.support.compare import assert_same_tensors, ir_tensors

IT = "iter_0000001"


def test_fsdp_dtensor_layout(mixtral_dir, tmp_path):
    """model.module. prefix (Megatron-FSDP's wrappers), global layer and expert numbers, SwiGLU halves, no
    _extra_state, Megatron's top entries; plain torch.distributed.checkpoint reads it."""
    run_cli("--saver", "core", "--ckpt-format", "fsdp_dtensor", "--load-dir", mixtral_dir, "--save-dir",
            tmp_path / "d")
    it = tmp_path / "d" / IT
    reader = DcpReader(it)
    assert sorted(reader.bytes_items) == ["args", "checkpoint_version", "iteration",
                                          "num_floating_point_operations_so_far"]
    experts = "model.module.decoder.layers.3.mlp.experts.local_experts.3"
    shapes = {k: v.shape for k, v in reader.tensors.items()}
    assert shapes[f"{experts}.linear_fc1.weight_w"] == shapes[f"{experts}.linear_fc1.weight_v"] == (96, 64)
    assert shapes[f"{experts}.linear_fc2.weight"] == (64, 96)
    assert not any("_extra_state" in k or k.endswith("linear_fc1.weight") for k in shapes)
    ir = ir_tensors(mixtral_dir)
    assert torch.equal(reader.read(f"{experts}.linear_fc1.weight_w"), ir["layers.3.moe.experts.3.gate.weight"])
    assert torch.equal(reader.read(f"{experts}.linear_fc1.weight_v"), ir["layers.3.moe.experts.3.up.weight"])
    import torch.distributed.checkpoint as dcp

    state = {"args": None, "iteration": None, "model": {"module.decoder.final_layernorm.weight": torch.empty(64)}}
    dcp.load(state, checkpoint_id=str(it), no_dist=True)  # what Megatron's --use-checkpoint-args reads first
    assert state["iteration"] == 1 and state["args"].ckpt_format == "fsdp_dtensor"
    assert torch.equal(state["model"]["module.decoder.final_layernorm.weight"], ir["final_norm.weight"])


def test_torch_dcp_keeps_extra_states(llama_dir, tmp_path):
    run_cli("--saver", "core", "--ckpt-format", "torch_dcp", "--load-dir", llama_dir, "--save-dir", tmp_path / "d")
    reader = DcpReader(tmp_path / "d" / IT)
    assert reader.read_object("model.decoder.layers.2.mlp.linear_fc1._extra_state") is None
    assert reader.tensors["model.decoder.layers.2.mlp.linear_fc1.weight"].shape == (256, 64)  # [gate ; up]


def test_dcp_formats_refuse_what_they_cannot_hold(mixtral_dir, tmp_path):
    out = run_cli("--saver", "core", "--ckpt-format", "fsdp_dtensor", "--pp", "2", "--load-dir", mixtral_dir,
                  "--save-dir", tmp_path / "a", expect_error=True)
    assert "--ckpt-format fsdp_dtensor stores every tensor whole, whatever the pipeline or expert layout" in out
    out = run_cli("--saver", "core", "--ckpt-format", "torch_dcp", "--expert-layout", "legacy_grouped",
                  "--load-dir", mixtral_dir, "--save-dir", tmp_path / "b", expect_error=True)
    assert "--ckpt-format torch_dcp holds sequential or grouped experts, not --expert-layout legacy_grouped" in out


def test_dcp_directory_without_megatron_args(llama_dir, tmp_path):
    """A torch_dist checkpoint that lost its metadata.json looks like a bare DCP directory: said so."""
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", llama_dir, "--save-dir", tmp_path / "d")
    (tmp_path / "d" / IT / "metadata.json").unlink()
    out = run_cli("inspect", tmp_path / "d", expect_error=True)
    assert "metadata.json listed in integrity.json is missing: the checkpoint is incomplete" in out
    (tmp_path / "d" / IT / "integrity.json").unlink()
    out = run_cli("inspect", tmp_path / "d", expect_error=True)
    assert "without Megatron's `args` entry and without metadata.json" in out


def test_single_grouped_weight(mixtral_dir, tmp_path):
    """TE's single grouped weight is the stack of the grouped layout's per-expert tensors of the same rank, as
    megatron-core's TE load hook builds it (`torch.stack([weight0, ..., weight{n-1}])`), at TP 2, EP 2, ETP 1."""
    layout = ["--transformer-impl", "te", "--tp", "2", "--ep", "2", "--etp", "1"]
    run_cli("--saver", "core", *layout, "--moe-grouped-gemm", "--moe-single-grouped-weight", "--load-dir",
            mixtral_dir, "--save-dir", tmp_path / "single")  # Megatron's pair of flags
    run_cli("--saver", "core", *layout, "--expert-layout", "grouped", "--load-dir", mixtral_dir,
            "--save-dir", tmp_path / "grouped")
    for rank in ("mp_rank_00_000", "mp_rank_01_001"):
        single = safe_load(tmp_path / "single" / IT / rank / "model_optim_rng.pt")
        grouped = safe_load(tmp_path / "grouped" / IT / rank / "model_optim_rng.pt")["model"]
        experts = "decoder.layers.2.mlp.experts"
        for fc in ("linear_fc1", "linear_fc2"):
            stacked = single["model"][f"{experts}.{fc}.weight"]
            assert torch.equal(stacked, torch.stack([grouped[f"{experts}.{fc}.weight{j}"] for j in range(2)]))
        assert stacked.shape == (2, 64, 96)
        assert (single["args"].moe_single_grouped_weight, single["args"].moe_grouped_gemm) == (True, True)
    out = run_cli("inspect", tmp_path / "single", "--no-tensors")
    assert "etp=1, expert_layout=single_grouped" in out
    run_cli("--saver", "core", "--load-dir", tmp_path / "single", "--save-dir", tmp_path / "sequential")
    assert_same_tensors(ir_tensors(mixtral_dir), ir_tensors(tmp_path / "sequential"))
    out = run_cli("--saver", "core", "--expert-layout", "single_grouped", "--load-dir", mixtral_dir,
                  "--save-dir", tmp_path / "local", expect_error=True)
    assert "--expert-layout single_grouped is Transformer Engine's grouped GEMM" in out
    out = run_cli("--saver", "core", *layout, "--moe-single-grouped-weight", "--expert-layout", "grouped",
                  "--load-dir", mixtral_dir, "--save-dir", tmp_path / "both", expect_error=True)
    assert "--moe-single-grouped-weight and --expert-layout grouped contradict each other" in out


def test_integrity_manifest_on_our_torch_dist(llama_dir, tmp_path):
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", llama_dir, "--save-dir", tmp_path / "d")
    it = tmp_path / "d" / IT
    manifest = json.loads((it / "integrity.json").read_text())
    import hashlib

    assert manifest["algorithm"] == "sha256"
    assert manifest["files"] == {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                 for p in sorted(it.iterdir()) if p.is_file() and p.name != "integrity.json"}
    # .metadata, two .distcp files, common.pt, metadata.json and run_config.yaml (for Megatron-Bridge)
    assert "integrity=6 files (SHA-256, verified as read)" in run_cli("inspect", tmp_path / "d", "--no-tensors")
    common = it / "common.pt"  # verified before it is unpickled
    common.write_bytes(common.read_bytes() + b"\0")
    out = run_cli("inspect", tmp_path / "d", expect_error=True)
    assert f"{common}: SHA-256 " in out and "does not match" in out


def _torch_file(path, pickled: bytes) -> None:
    """A torch.save archive holding the given pickle (protocol 2, as torch.save writes)."""
    with zipfile.ZipFile(path, "w") as z:
        for name, data in (("data.pkl", pickled), ("byteorder", b"little"), ("version", b"3\n")):
            z.writestr(f"archive/{name}", data)


@pytest.mark.parametrize("name", ["megatron.core.enums.Fp4Recipe", "megatron.core.transformer.enums.ModelType",
                                  "megatron.core.rerun_state_machine.RerunValidationStatus",
                                  "megatron.core.rerun_state_machine.Call",
                                  "megatron.core.rerun_state_machine.Caller"])
def test_newer_megatron_classes_in_common_state_are_inert(name, tmp_path):
    module, cls = name.rsplit(".", 1)
    _torch_file(tmp_path / "common.pt", f"\x80\x02c{module}\n{cls}\nK\x02\x85R.".encode("latin-1"))  # {cls}(2)
    loaded = safe_load(tmp_path / "common.pt")
    assert type(loaded).__name__ == cls and loaded.args == (2,)


def test_unknown_megatron_class_is_refused(tmp_path):
    pickled = b"\x80\x02cmegatron.core.dist_checkpointing.mapping\nShardedTensor\n)R."
    _torch_file(tmp_path / "common.pt", pickled)
    with pytest.raises(Exception, match="refusing to unpickle: the file asks for the Python global "
                                        "`megatron.core.dist_checkpointing.mapping.ShardedTensor`"):
        safe_load(tmp_path / "common.pt")


@pytest.mark.parametrize("cls,base", [("MCoreMetadata", b"ctorch.distributed.checkpoint.metadata\nMetadata\n"),
                                      ("MCoreSavePlan", b"ctorch.distributed.checkpoint.planner\nSavePlan\n")])
def test_mcore_metadata_classes_in_dot_metadata(cls, base, llama_dir, tmp_path):
    """megatron-core (Oct-Nov 2025) pickled its Metadata / SavePlan subclasses into `.metadata`."""
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", llama_dir, "--save-dir", tmp_path / "d")
    it = tmp_path / "d" / IT
    (it / "integrity.json").unlink()  # the file is rewritten below
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.planner import SavePlan

    md = FileSystemReader(str(it)).read_metadata()
    if cls == "MCoreSavePlan":
        md.planner_data = {"plan": SavePlan(items=[])}
    data = pickle.dumps(md, protocol=2)
    assert base in data
    (it / ".metadata").write_bytes(data.replace(base, f"cmegatron.core.dist_checkpointing.strategies.torch\n{cls}\n"
                                                .encode()))
    assert type(read_metadata(it)).__name__ == "Metadata"
    assert_same_tensors(ir_tensors(llama_dir), ir_tensors(tmp_path / "d"))
    (it / ".metadata").write_bytes(data.replace(base, b"cmegatron.core.dist_checkpointing.strategies.torch\nEvil\n"))
    out = run_cli("inspect", tmp_path / "d", expect_error=True)
    assert "refusing to unpickle: it asks for the Python global " \
           "`megatron.core.dist_checkpointing.strategies.torch.Evil`" in out
