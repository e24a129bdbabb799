"""A small config claiming a huge model: a million layers, experts or MTP modules beside a few hundred KB of
weights. Every reader compares the sizes a config declares with what the files hold (mconvert/ir/sizes.py) before
building anything per layer or expert, and refuses naming the file and the field.

The memory bound: each test traces the Python allocations of the refused command (tracemalloc). Building
anything per layer for a million layers costs at least a name string per layer (over 50 bytes each, so 50 MB and
more; the readers built about ten per layer, and per-layer tuples of layer numbers besides); refusing before that
costs what reading the headers and the config costs, under a megabyte for these tiny checkpoints. 32 MiB sits
between the two with room for either side to move by a factor of several.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
import torch

from mconvert.io.torch_pickle import safe_load
from tests.adversarial.crafting import edit_dcp
from tests.support.refusals import cli, convert_refused, fresh, mtrain_cli, refused, resume_refused

HUGE = 1_000_000
LIMIT = 32 * 2**20  # bytes of Python allocations a refusal may trace (see the module docstring)


def refused_within_memory(run):
    """What `run()` returns, with the peak of the Python allocations it made below LIMIT."""
    tracemalloc.start()
    try:
        out = run()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < LIMIT, f"the refusal allocated {peak / 2**20:.0f} MiB first:\n{out}"
    return out


def _edit_json(path: Path, **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


HF_CLAIMS = [("llama_mistral", "sources", {"num_hidden_layers": HUGE}, "num_hidden_layers=1000000"),
             ("mixtral_hf", "sources", {"num_local_experts": HUGE}, "num_local_experts=1000000"),
             ("gpt2_hf", "sources", {"n_layer": HUGE}, "n_layer=1000000"),
             ("qwen3_moe_hf", "newer_sources", {"num_hidden_layers": HUGE, "decoder_sparse_step": 2},
              "num_hidden_layers=1000000"),
             ("qwen3_moe_hf", "newer_sources", {"num_experts": HUGE, "num_local_experts": HUGE},
              "num_experts=1000000"),
             # no count to loop over, but sizes no file holds: the exact count refuses them
             ("llama_mistral", "sources", {"vocab_size": 10**12}, "vocabulary 1,000,000,000,000"),
             ("llama_mistral", "sources", {"intermediate_size": 10**9}, "4 layers"),
             ("gpt2_hf", "sources", {"n_positions": 10**9}, "4 layers")]


@pytest.mark.parametrize("name,where,fields,culprit", HF_CLAIMS,
                         ids=[f"{n}-{next(iter(f))}" for n, _, f, _ in HF_CLAIMS])
def test_hf_config_claiming_a_million(request, tmp_path, name, where, fields, culprit):
    src = fresh(request.getfixturevalue(where)[name], tmp_path)
    _edit_json(src / "config.json", **fields)
    culprits = (f"{src / 'config.json'}", culprit, "the config declares more than the files hold")
    refused_within_memory(lambda: convert_refused(src, tmp_path, culprits=culprits))
    refused_within_memory(lambda: refused(cli("inspect", src, expect_error=True), *culprits))


@pytest.mark.parametrize("field", ["num_hidden_layers", "n_routed_experts", "first_k_dense_replace",
                                   "num_nextn_predict_layers"])
def test_deepseek_config_claiming_a_million(deepseek_sources, tmp_path, field):
    src = fresh(deepseek_sources["deepseek_hf"], tmp_path)
    fields = {field: HUGE} | ({"num_hidden_layers": HUGE} if field == "first_k_dense_replace" else {})
    _edit_json(src / "config.json", **fields)
    refused_within_memory(lambda: convert_refused(src, tmp_path, culprits=(
        f"{src / 'config.json'}", "the config declares more than the files hold")))


def test_hf_config_claiming_more_layers_than_the_values_stored(sources, tmp_path):
    """Few enough layers that each could hold a value, too many for the model's sizes: the exact count refuses."""
    src = fresh(sources["llama_mistral"], tmp_path)
    _edit_json(src / "config.json", num_hidden_layers=400)
    out = convert_refused(src, tmp_path, culprits=(f"{src / 'config.json'}", "400 layers",
                                                   "the config declares more than the files hold"))
    assert "values (400 layers, hidden size 64, vocabulary 300)" in out


def _edit_args(src: Path, edit) -> None:
    for f in [*src.glob("iter_*/common.pt"), *src.glob("iter_*/mp_rank_*/model_optim_rng.pt")]:
        state = safe_load(f, mmap=False)
        edit(state["args"])
        torch.save(state, f)


# The torch-format readers count the layers in the rank files first, and say so; the others compare the sizes.
FILES_HOLD_4 = "the rank files hold 4 layers, args.num_layers says 1000000"
DECLARES_MORE = "the config declares more than the files hold"
MEGATRON_CLAIMS = [("core", "sources", "num_layers", FILES_HOLD_4), ("legacy", "sources", "num_layers", FILES_HOLD_4),
                   ("core", "sources", "moe_layer_freq", FILES_HOLD_4),
                   ("single_grouped", "newer_sources", "num_experts", DECLARES_MORE),
                   ("torch_dist", "sources", "num_layers", DECLARES_MORE),
                   ("mixtral_dist", "newer_sources", "num_experts", DECLARES_MORE),
                   ("torch_dist", "sources", "mtp_num_layers", DECLARES_MORE)]


@pytest.mark.parametrize("name,where,field,culprit", MEGATRON_CLAIMS,
                         ids=[f"{n}-{f}" for n, _, f, _ in MEGATRON_CLAIMS])
def test_megatron_args_claiming_a_million(request, tmp_path, name, where, field, culprit):
    src = fresh(request.getfixturevalue(where)[name], tmp_path)

    def edit(args):
        if field == "moe_layer_freq":  # a pattern a reader expands over every layer
            args.num_experts, args.moe_layer_freq, args.num_layers = 4, 2, HUGE
        else:
            setattr(args, field, HUGE)

    _edit_args(src, edit)
    named = () if culprit == FILES_HOLD_4 else (f"args.{field}=1000000",)
    refused_within_memory(lambda: convert_refused(src, tmp_path, saver="hf", culprits=(*named, culprit)))


def test_megatron_args_claiming_a_million_tensor_parallel_ranks(sources, tmp_path):
    src = fresh(sources["core"], tmp_path)
    _edit_args(src, lambda args: setattr(args, "tensor_model_parallel_size", HUGE))
    refused_within_memory(lambda: convert_refused(src, tmp_path, saver="hf", culprits=(
        "args say TP=1000000, PP=2, EP=1, 2,000,000 rank folders, but there are 4",)))


@pytest.mark.parametrize("name", ["torch_dcp", "fsdp_dtensor"])
def test_dcp_args_claiming_a_million_layers(newer_sources, tmp_path, name):
    src = fresh(newer_sources[name], tmp_path)
    edit_dcp(next(src.glob("iter_*")), lambda s: setattr(s["args"], "num_layers", HUGE))
    refused_within_memory(lambda: convert_refused(src, tmp_path, saver="hf", culprits=(
        "args.num_layers=1000000", "the config declares more than the files hold")))


def _claim_in_mtrain_json(run: Path, **fields) -> Path:
    meta_file = run / "step_0000002" / "mtrain.json"
    meta = json.loads(meta_file.read_text())
    meta["model_config"].update(fields)
    meta_file.write_text(json.dumps(meta))
    return meta_file


@pytest.mark.parametrize("field", ["num_layers", "num_experts"])
def test_mtrain_json_claiming_a_million_converted(mtrain_run, tmp_path, field):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    extra = {"num_experts": HUGE, "moe_top_k": 2} if field == "num_experts" else {"num_layers": HUGE}
    meta_file = _claim_in_mtrain_json(run, **extra)
    refused_within_memory(lambda: convert_refused(run, tmp_path, saver="llama_mistral", culprits=(
        str(meta_file), "the config declares more than the files hold")))


def test_mtrain_json_claiming_a_million_layers_resumed(mtrain_run, tmp_path):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    meta_file = _claim_in_mtrain_json(run, num_layers=HUGE)
    refused_within_memory(lambda: resume_refused(mtrain_run, run, tmp_path, str(meta_file), "1,000,000 layers",
                                                 "the config declares more than the files hold"))


def test_mtrain_json_step_contradicting_its_directory(mtrain_run, tmp_path):
    """A step directory copied under another name (or an mtrain.json copied into another step) would resume at
    a step its directory does not say, and its checkpoints would overwrite others."""
    run = fresh(mtrain_run["run"], tmp_path, "run")
    meta_file = run / "step_0000002" / "mtrain.json"
    meta = json.loads(meta_file.read_text())
    meta["step"] = 7
    meta_file.write_text(json.dumps(meta))
    culprits = (str(meta_file), "step=7 contradicts its directory step_0000002")
    resume_refused(mtrain_run, run, tmp_path, *culprits)
    convert_refused(run, tmp_path, saver="llama_mistral", culprits=culprits)


@pytest.mark.parametrize("name", ["torch_dcp", "mtrain"])
def test_dcp_metadata_claiming_a_huge_tensor_does_not_vouch_for_the_config(newer_sources, mtrain_run, tmp_path,
                                                                            name):
    """A .metadata can claim any shape: a tensor of 10^12 values whose one chunk is 100 bytes of a file would make
    a million layers look stored. The values counted are bounded by the bytes of the files the chunks lie in."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

    from tests.adversarial.crafting import read_metadata_trusted, write_metadata

    if name == "mtrain":
        src = fresh(mtrain_run["run"], tmp_path, "run")
        step, fqn = src / "step_0000002", "model.layers.0.attn_norm.weight"
        meta_file = _claim_in_mtrain_json(src, num_layers=HUGE)
    else:
        src = fresh(newer_sources[name], tmp_path)
        step = next(src.glob("iter_*"))
        fqn = next(k for k in read_metadata_trusted(step).state_dict_metadata if k.endswith("final_layernorm.weight"))
        edit_dcp(step, lambda s: setattr(s["args"], "num_layers", HUGE))
    md = read_metadata_trusted(step)
    real = md.state_dict_metadata[fqn]
    index = next(k for k in md.storage_data if k.fqn == fqn)
    huge = (10**12,)
    md.state_dict_metadata[fqn + "_huge"] = TensorStorageMetadata(real.properties, torch.Size(huge),
                                                                  [ChunkStorageMetadata(torch.Size([0]),
                                                                                        torch.Size(huge))])
    md.storage_data[MetadataIndex(fqn + "_huge", torch.Size([0]))] = md.storage_data[index]
    write_metadata(step, md)
    if name == "mtrain":
        refused_within_memory(lambda: convert_refused(src, tmp_path, saver="llama_mistral", culprits=(
            str(meta_file), "the config declares more than the files hold")))
    else:
        refused_within_memory(lambda: convert_refused(src, tmp_path, saver="hf", culprits=(
            "args.num_layers=1000000", "the config declares more than the files hold")))


@pytest.mark.parametrize("saved", [["not", "a", "mapping"], {"optim": "fast", "train": {"steps": 2}},
                                   {"optim": {"lr": "high"}, "train": {"steps": 2}}, {"train": {"steps": 0}}])
def test_mtrain_json_saved_config_of_another_shape_resumes(mtrain_run, tmp_path, saved):
    """The run config a step saved only feeds a note (how the learning-rate schedule changed); one of another shape
    gives no note, never a traceback (an AttributeError or ZeroDivisionError before)."""
    run = fresh(mtrain_run["run"], tmp_path, "run")
    meta_file = run / "step_0000002" / "mtrain.json"
    meta = json.loads(meta_file.read_text())
    meta["config"] = saved
    meta_file.write_text(json.dumps(meta))
    config = mtrain_run["config"].to_dict()
    config["checkpoint"]["dir"], config["train"]["steps"] = str(run), 3
    (tmp_path / "run.json").write_text(json.dumps(config))
    code, out = mtrain_cli("pretrain", "--config", tmp_path / "run.json")
    assert code == 0, out
    assert f"resumed from {run / 'step_0000002'} at step 2" in out and "learning-rate schedule" not in out


def test_generate_from_a_config_claiming_a_million_layers(sources, tmp_path):
    """mtrain generate (and evaluate, serve, finetune) read checkpoints through mconvert's loaders: refused before
    a model is built."""
    src = fresh(sources["llama_mistral"], tmp_path)
    _edit_json(src / "config.json", num_hidden_layers=HUGE)
    code, out = refused_within_memory(lambda: mtrain_cli("generate", "--load", src, "--tokens", "1 5 9"))
    assert code != 0
    refused(out, f"{src / 'config.json'}: num_hidden_layers=1000000", "the config declares more than the files hold")
