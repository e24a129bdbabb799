"""Silent acceptance of tensors the config does not account for: a layer more than the config says (in every
loader), a DeepSeek config whose dense layers disagree with the tensors, a stack of experts (fused HF layout,
single grouped Megatron weight) holding more or fewer experts than the config, integer tensors under weight
names. Each is refused naming the tensors, never converted into a model that drops or garbles them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert.io.torch_pickle import safe_load
from tests.adversarial.crafting import edit_dcp
from tests.support.refusals import cli, convert_refused, fresh


def _edit_hf(src: Path, edit) -> None:
    weights = load_file(src / "model.safetensors")
    edit(weights)
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})


def _edit_config(src: Path, **fields) -> None:
    config = json.loads((src / "config.json").read_text())
    config.update(fields)
    (src / "config.json").write_text(json.dumps(config))


def _edit_args(src: Path, edit) -> None:
    """Apply `edit` to the args of every rank file (torch) or of common.pt (torch_dist, zarr)."""
    for f in [*src.glob("iter_*/common.pt"), *src.glob("iter_*/mp_rank_*/model_optim_rng.pt")]:
        state = safe_load(f, mmap=False)
        edit(state["args"])
        torch.save(state, f)


def _copy_layer(weights: dict, prefix: str, src: int, dst: int) -> None:
    for key in [k for k in weights if k.startswith(f"{prefix}{src}.")]:
        weights[f"{prefix}{dst}." + key[len(f"{prefix}{src}."):]] = weights[key].clone()


# -- one layer more than the config says, in every loader ------------------------------------------------------------

HF_EXTRA_LAYER = [("llama_mistral", "sources", "model.layers.4."), ("mixtral_hf", "sources", "model.layers.4."),
                  ("qwen3_moe_hf", "newer_sources", "model.layers.4.")]


@pytest.mark.parametrize("name,where,culprit", HF_EXTRA_LAYER, ids=[n for n, _, _ in HF_EXTRA_LAYER])
def test_hf_checkpoint_with_a_layer_more_than_its_config(request, tmp_path, name, where, culprit):
    src = fresh(request.getfixturevalue(where)[name], tmp_path)
    _edit_hf(src, lambda w: _copy_layer(w, "model.layers.", 3, 4))
    convert_refused(src, tmp_path, culprits=("Extra tensors", culprit, "4 layers"))


def test_deepseek_hf_layer_after_the_last_is_an_mtp_layer_or_refused(deepseek_sources, tmp_path):
    """DeepSeek's layers after num_hidden_layers are MTP modules: a plain decoder layer there lacks their tensors."""
    src = fresh(deepseek_sources["deepseek_hf"], tmp_path)
    _edit_config(src, num_hidden_layers=2)  # layers 2 (a decoder layer) and 3 (the MTP module) follow
    convert_refused(src, tmp_path, culprits=("model.layers.2.enorm.weight", "Missing tensors"))


MEGATRON_FEWER_LAYERS = [("core", "sources", "rank files hold 4 layers, args.num_layers says 3"),
                         ("torch_dist", "sources", "stacks [4] (layers), the args say [3]"),
                         ("zarr", "sources", "stacks [4] (layers), the args say [3]"),
                         ("deepseek_core", "deepseek_sources", "rank files hold 3 layers, args.num_layers says 2")]


@pytest.mark.parametrize("name,where,culprit", MEGATRON_FEWER_LAYERS, ids=[n for n, _, _ in MEGATRON_FEWER_LAYERS])
def test_megatron_args_saying_one_layer_less(request, tmp_path, name, where, culprit):
    src = fresh(request.getfixturevalue(where)[name], tmp_path)
    _edit_args(src, lambda args: setattr(args, "num_layers", args.num_layers - 1))
    convert_refused(src, tmp_path, saver="hf", culprits=(culprit,))


def test_legacy_rank_files_with_a_layer_more(sources, tmp_path):
    src = fresh(sources["legacy"], tmp_path)
    _edit_args(src, lambda args: setattr(args, "num_layers", args.num_layers - 1))
    convert_refused(src, tmp_path, saver="gpt2_hf", culprits=("4 layers", "args.num_layers says 3"))


@pytest.mark.parametrize("name", ["torch_dcp", "fsdp_dtensor"])
def test_dcp_formats_with_a_layer_more_than_args(newer_sources, tmp_path, name):
    src = fresh(newer_sources[name], tmp_path)
    edit_dcp(next(src.glob("iter_*")), lambda s: setattr(s["args"], "num_layers", 3))
    convert_refused(src, tmp_path, saver="hf", culprits=("Extra tensors", "decoder.layers.3.", "(3 layers)"))


def test_mtrain_step_with_a_layer_more_than_its_config(mtrain_run, tmp_path):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    meta_file = run / "step_0000002" / "mtrain.json"
    meta = json.loads(meta_file.read_text())
    layers = meta["model_config"]["num_layers"]
    meta["model_config"]["num_layers"] = layers - 1
    meta_file.write_text(json.dumps(meta))
    convert_refused(run, tmp_path, saver="llama_mistral", culprits=("Extra tensors", f"layers.{layers - 1}."))


# -- DeepSeek's dense layers: config against tensors -----------------------------------------------------------------

@pytest.mark.parametrize("first_dense", [0, 2])
def test_deepseek_first_k_dense_replace_disagreeing_with_the_tensors(deepseek_sources, tmp_path, first_dense):
    src = fresh(deepseek_sources["deepseek_hf"], tmp_path)  # one dense layer, then experts
    _edit_config(src, first_k_dense_replace=first_dense)
    culprit = "model.layers.0.mlp.gate.weight" if first_dense == 0 else "model.layers.1.mlp.experts.0.down_proj"
    convert_refused(src, tmp_path, culprits=(culprit,))


@pytest.mark.parametrize("name", ["deepseek_core", "deepseek_dist"])
def test_deepseek_moe_layer_freq_disagreeing_with_the_tensors(deepseek_sources, newer_sources, tmp_path, name):
    src = fresh({**deepseek_sources, **newer_sources}[name], tmp_path)
    _edit_args(src, lambda args: setattr(args, "moe_layer_freq", [0, 0, 1]))
    convert_refused(src, tmp_path, saver="deepseek_hf", culprits=("decoder.layers.1.mlp.linear_fc1.weight",
                                                                  "Missing tensors", "Extra tensors"))


# -- stacks of experts holding another number of experts ------------------------------------------------------------

def _fuse_experts(weights: dict, layer: int, experts: int) -> None:
    """transformers 5's in-memory layout: gate_up_proj [E, 2f, h], down_proj [E, h, f]."""
    prefix = f"model.layers.{layer}.mlp.experts."
    gate = [weights.pop(f"{prefix}{e}.gate_proj.weight") for e in range(experts)]
    up = [weights.pop(f"{prefix}{e}.up_proj.weight") for e in range(experts)]
    down = [weights.pop(f"{prefix}{e}.down_proj.weight") for e in range(experts)]
    weights[prefix + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
    weights[prefix + "down_proj"] = torch.stack(down)


@pytest.mark.parametrize("count", [3, 5])
def test_fused_hf_experts_of_another_count(newer_sources, tmp_path, count):
    src = fresh(newer_sources["qwen3_moe_hf"], tmp_path)  # experts in layers 1 and 3, 4 of them

    def edit(w):
        for layer in (1, 3):
            _fuse_experts(w, layer, 4)
        for key in ("gate_up_proj", "down_proj"):
            t = w[f"model.layers.1.mlp.experts.{key}"]
            w[f"model.layers.1.mlp.experts.{key}"] = torch.cat([t, t[:1]]) if count == 5 else t[:count].clone()

    _edit_hf(src, edit)
    convert_refused(src, tmp_path, culprits=("model.layers.1.mlp.experts.gate_up_proj", f"[{count}, ",
                                             f"gives {2 * count} tensors", "implies 8"))


@pytest.mark.parametrize("count", [3, 5])
def test_single_grouped_weight_of_another_expert_count(newer_sources, tmp_path, count):
    src = fresh(newer_sources["single_grouped"], tmp_path)
    for f in src.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = safe_load(f, mmap=False)
        for key in [k for k in state["model"] if ".mlp.experts.linear_fc" in k and k.endswith(".weight")]:
            t = state["model"][key]
            state["model"][key] = torch.cat([t, t[:1]]) if count == 5 else t[:count].clone()
        torch.save(state, f)
    convert_refused(src, tmp_path, saver="mixtral_hf", culprits=("decoder.layers.0.mlp.experts.linear_fc1.weight",
                                                                 f"[{count}, 192, 64]", "implies 8"))


def test_qwen3_moe_expert_count_spelled_twice_differently(newer_sources, tmp_path):
    """transformers 5 writes num_local_experts, the hub's configs num_experts: a config with both must agree (the
    tensors' count won, whatever the other said)."""
    src = fresh(newer_sources["qwen3_moe_hf"], tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["num_experts"] = config["num_local_experts"] - 1
    (src / "config.json").write_text(json.dumps(config))
    convert_refused(src, tmp_path, culprits=("config.json", "num_experts=3", "num_local_experts=4", "disagree"))



@pytest.mark.parametrize("value", [3, "0", [0.0], [True]])  # null means [] as in transformers
def test_qwen3_moe_mlp_only_layers_not_a_list_of_layers(newer_sources, tmp_path, value):
    """mlp_only_layers of another kind was refused with Python's own words ("'int' object is not iterable"), or
    taken ("0" -> layer 0); the error names the field."""
    src = fresh(newer_sources["qwen3_moe_hf"], tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["mlp_only_layers"] = value
    (src / "config.json").write_text(json.dumps(config))
    convert_refused(src, tmp_path, culprits=("config.json", "mlp_only_layers must be a list of layer numbers"))

@pytest.mark.parametrize("head", ["distinct", "equal"])
def test_torch_dist_tied_model_with_a_stored_output_layer(sources, tmp_path, head):
    """A tied model's output_layer.weight in a torch_dist checkpoint was ignored whatever it held (exit 0)."""
    src = tmp_path / "src"
    cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", sources["gpt2_hf"], "--save-dir", src, "-q")
    (src / "iter_0000001" / "integrity.json").unlink()  # the attacker rewrites it, or there is none
    embed = "embedding.word_embeddings.weight"
    edit_dcp(src / "iter_0000001", lambda s: s.update({"output_layer.weight": s[embed] + (head == "distinct")}))
    if head == "equal":
        cli("--saver", "gpt2_hf", "--load-dir", src, "--save-dir", tmp_path / "ok", "-q")
        return
    convert_refused(src, tmp_path, saver="gpt2_hf", culprits=("output_layer.weight", "differs from", embed))


# -- integer tensors under weight names -----------------------------------------------------------------------------

def test_integer_weight_in_hf(sources, tmp_path):
    src = fresh(sources["llama_mistral"], tmp_path)
    key = "model.layers.0.self_attn.q_proj.weight"
    _edit_hf(src, lambda w: w.update({key: (w[key] * 100).to(torch.int32)}))
    convert_refused(src, tmp_path, culprits=(key, "int32", "floating-point"))


def test_boolean_weight_in_megatron_rank_file(sources, tmp_path):
    src = fresh(sources["core"], tmp_path)
    f = sorted(src.glob("iter_*/mp_rank_*/model_optim_rng.pt"))[0]
    state = safe_load(f, mmap=False)
    key = "decoder.layers.0.mlp.linear_fc1.weight"
    state["model"][key] = state["model"][key] > 0
    torch.save(state, f)
    convert_refused(src, tmp_path, saver="llama_mistral", culprits=(key, "bool", "floating-point"))


def test_integer_weight_in_torch_dcp(newer_sources, tmp_path):
    src = fresh(newer_sources["torch_dcp"], tmp_path)
    key = "model.decoder.layers.0.self_attention.linear_qkv.weight"
    edit_dcp(next(src.glob("iter_*")), lambda s: s.update({key: (s[key] * 100).to(torch.int16)}))
    convert_refused(src, tmp_path, saver="llama_mistral", culprits=(key, "int16", "floating-point"))



def test_integer_weight_in_an_mtrain_step(mtrain_run, tmp_path):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    key = "layers.0.attn.q.weight"
    edit_dcp(run / "step_0000002", lambda s: s["model"].update({key: (s["model"][key] * 100).to(torch.int32)}))
    convert_refused(run, tmp_path, saver="llama_mistral", culprits=(f"model.{key}", "int32", "floating-point"))
