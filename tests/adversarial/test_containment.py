"""Reads outside the checkpoint: names and links that lead out of it, on every loader and on mtrain.

The `outside` directory holds a plausible weights file and a secret; the suite's audit hook fails any test in
which a file there is opened. Each case must be refused with the entry named and nothing left behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.adversarial.crafting import read_metadata_trusted, repoint_storage, write_metadata
from tests.support.refusals import cli, convert_refused, fresh, refused, resume_refused

INDEX = "model.safetensors.index.json"


def _indexed(src: Path) -> dict:
    """Turn the single-file HF checkpoint `src` into an indexed one; returns the weight_map to edit."""
    from safetensors import safe_open

    with safe_open(src / "model.safetensors", "pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def _write_index(src: Path, weight_map: dict) -> None:
    (src / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("how", ["relative ../", "absolute", "link inside pointing out"])
def test_index_weight_map_leading_out(sources, tmp_path, outside, how):
    src = fresh(sources["llama_mistral"], tmp_path)
    weight_map = _indexed(src)
    secret = outside / "secret.safetensors"
    if how == "relative ../":
        name = os.path.relpath(secret, src)
    elif how == "absolute":
        name = str(secret)
    else:
        name = "model-00002-of-00002.safetensors"
        (src / name).symlink_to(secret)
    weight_map["model.embed_tokens.weight"] = name
    _write_index(src, weight_map)
    culprit = name if how != "link inside pointing out" else name
    convert_refused(src, tmp_path, culprits=(culprit, "outside the checkpoint"))


def test_bin_index_leading_out(sources, tmp_path, outside):
    src = fresh(sources["llama_bin"], tmp_path)
    shutil.copyfile(outside / "secret.txt", tmp_path / "elsewhere.bin")
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "../elsewhere.bin"}}))
    convert_refused(src, tmp_path, culprits=("../elsewhere.bin", "outside the checkpoint"))


@pytest.mark.parametrize("family", ["llama_mistral", "gpt2_hf", "mixtral_hf"])
@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_hf_file_linking_out(sources, tmp_path, outside, family, name):
    """A tokenizer file linked to a secret would be copied verbatim into the output."""
    src = fresh(sources[family], tmp_path)
    (src / name).unlink()
    (src / name).symlink_to(outside / ("secret.safetensors" if name.endswith("safetensors") else "secret.txt"))
    convert_refused(src, tmp_path, culprits=(name, "symbolic link", "outside the checkpoint"))


def test_hf_cache_snapshot_links_stay_in_their_repo(sources, tmp_path, outside):
    """A HF cache snapshot's links into ../../blobs are fine; one that leaves the repo folder is refused."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted(sources["llama_mistral"].iterdir())):
        shutil.copyfile(f, repo / "blobs" / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    cli("--saver", "core", "--load-dir", snapshot, "--save-dir", tmp_path / "ok", "-q")  # the control
    assert (tmp_path / "ok" / "latest_checkpointed_iteration.txt").is_file()
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to(outside / "secret.txt")
    convert_refused(snapshot, tmp_path, culprits=("tokenizer.json", "outside the checkpoint"))


@pytest.mark.parametrize("how", ["relative ../", "absolute"])
@pytest.mark.parametrize("fmt", ["torch_dist", "mtrain"])
def test_dcp_relative_path_leading_out(sources, mtrain_run, tmp_path, outside, how, fmt):
    src = fresh(sources["torch_dist"] if fmt == "torch_dist" else mtrain_run["run"], tmp_path)
    root = next(src.glob("iter_*")) if fmt == "torch_dist" else src / "step_0000002"
    secret = outside / "secret.safetensors"
    name = os.path.relpath(secret, root) if how == "relative ../" else str(secret)
    repoint_storage(root, name)
    convert_refused(src, tmp_path, saver="core" if fmt == "mtrain" else "llama_mistral",
                    culprits=(".metadata relative_path", name, "outside the checkpoint"))


def test_mtrain_resume_relative_path_leading_out(mtrain_run, tmp_path, outside):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    repoint_storage(run / "step_0000002", os.path.relpath(outside / "secret.safetensors", run / "step_0000002"))
    resume_refused(mtrain_run, run, tmp_path, "step_0000002", "relative_path", "outside the checkpoint",
                   "To resume from step_0000001")


@pytest.mark.parametrize("latest", ["../outside", "/etc", "step_0000002/../../x"])
def test_mtrain_latest_naming_something_else(mtrain_run, tmp_path, latest):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    (run / "latest").write_text(latest + "\n")
    convert_refused(run, tmp_path, saver="llama_mistral", culprits=("latest", "not a step directory"))
    resume_refused(mtrain_run, run, tmp_path, "latest", "not a step directory")


def test_mtrain_step_linking_out(mtrain_run, tmp_path, outside):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    shutil.copytree(run / "step_0000002", outside / "copied_step", dirs_exist_ok=True)
    try:
        (run / "step_0000009").symlink_to(outside / "copied_step")
        (run / "latest").write_text("step_0000009\n")
        convert_refused(run, tmp_path, saver="llama_mistral", culprits=("step_0000009", "outside the checkpoint"))
    finally:
        shutil.rmtree(outside / "copied_step")


@pytest.mark.parametrize("what", ["rank folder", "iteration folder", "rank file"])
@pytest.mark.parametrize("fmt", ["core", "legacy"])
def test_megatron_links_leading_out(sources, tmp_path, outside, what, fmt):
    src = fresh(sources[fmt], tmp_path)
    it_dir = next(src.glob("iter_*"))
    rank_dir = sorted(it_dir.glob("mp_rank_*"))[-1]
    target = {"rank folder": rank_dir, "iteration folder": it_dir, "rank file": rank_dir / "model_optim_rng.pt"}
    moved = target[what]
    copy = outside / f"{fmt}-{what.replace(' ', '_')}"
    shutil.move(moved, copy)
    try:
        moved.symlink_to(copy)
        convert_refused(src, tmp_path, "--loader", fmt, culprits=(moved.name, "outside the checkpoint"))
    finally:
        moved.unlink()
        shutil.rmtree(copy) if copy.is_dir() else copy.unlink()


def test_zarr_array_linking_out(sources, tmp_path, outside):
    src = fresh(sources["zarr"], tmp_path)
    array = next(p for p in next(src.glob("iter_*")).iterdir() if (p / ".zarray").is_file())
    copy = outside / "array"
    shutil.move(array, copy)
    try:
        array.symlink_to(copy)
        convert_refused(src, tmp_path, culprits=(array.name, "outside the checkpoint"))
    finally:
        shutil.rmtree(copy)


def test_megatron_args_tokenizer_model_outside(sources, tmp_path, outside, llama_dir):
    """args.tokenizer_model is a path the checkpoint names: used only inside it, or when the user passes it."""
    import torch

    from mconvert.io.torch_pickle import safe_load

    src = fresh(sources["core"], tmp_path)
    tok = outside / "tokenizer"
    tok.mkdir(exist_ok=True)
    shutil.copyfile(outside / "secret.txt", tok / "tokenizer.json")
    for f in src.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = safe_load(f, mmap=False)
        state["args"].tokenizer_model = str(tok)
        torch.save(state, f)
    shutil.rmtree(next(src.glob("iter_*")) / "tokenizer")
    convert_refused(src, tmp_path, saver="llama_mistral",
                    culprits=("args.tokenizer_model", "outside the checkpoint", f"pass --tokenizer {tok}"))


def test_fifo_in_the_checkpoint(sources, tmp_path):
    """A FIFO would block a reader forever: refused before anything is opened."""
    src = fresh(sources["llama_mistral"], tmp_path)
    (src / "tokenizer.json").unlink()
    os.mkfifo(src / "tokenizer.json")
    convert_refused(src, tmp_path, culprits=("tokenizer.json", "not a regular file"))


def test_inspect_and_compare_refuse_too(sources, tmp_path, outside):
    src = fresh(sources["llama_mistral"], tmp_path)
    (src / "config.json").unlink()
    (src / "config.json").symlink_to(outside / "secret.txt")
    refused(cli("inspect", src, expect_error=True), "config.json", "outside the checkpoint")
    refused(cli("compare", src, sources["llama_mistral"], expect_error=True), "config.json")


def test_dcp_metadata_with_mistyped_records(sources, tmp_path):
    src = fresh(sources["torch_dist"], tmp_path)
    it_dir = next(src.glob("iter_*"))
    md = read_metadata_trusted(it_dir)
    key = next(iter(md.storage_data))
    info = md.storage_data[key]
    md.storage_data[key] = type(info)(relative_path=42, offset=info.offset, length=info.length)
    write_metadata(it_dir, md)
    convert_refused(src, tmp_path, culprits=(".metadata", "corrupt storage record"))
