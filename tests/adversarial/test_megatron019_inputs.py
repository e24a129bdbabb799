"""megatron-core 0.17-0.19's formats as an attacker shapes them: integrity.json with entries missing, renamed,
leading out or in another hash's form, files changed under an intact manifest; torch_dcp / fsdp_dtensor without
args, under foreign prefixes, duplicated under two wrapper depths, with misshapen tensors; singleton_local_shards
with an expert's SwiGLU half missing or doubled. Each refused naming the file or tensor; nothing read outside."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.adversarial.crafting import edit_dcp
from tests.support.refusals import cli, convert_refused, fresh

IT = "iter_0000001"

# -- integrity.json ----------------------------------------------------------------------------------------------------


def _edit_manifest(src: Path, edit) -> Path:
    path = src / IT / "integrity.json"
    manifest = json.loads(path.read_text())
    edit(manifest["files"])
    path.write_text(json.dumps(manifest))
    return path


@pytest.mark.parametrize("name", [".metadata", "__0_1.distcp", "common.pt", "metadata.json"])
def test_manifest_covering_all_but_one_file(newer_sources, tmp_path, name):
    src = fresh(newer_sources["torch_dist_integrity"], tmp_path)
    _edit_manifest(src, lambda files: files.pop(name))
    convert_refused(src, tmp_path, saver="llama_mistral", culprits=(f"{IT}/{name}", "not listed in integrity.json"))


def test_manifest_with_a_renamed_entry(newer_sources, tmp_path):
    src = fresh(newer_sources["torch_dist_integrity"], tmp_path)
    _edit_manifest(src, lambda files: files.update({".metadata.bak": files.pop(".metadata")}))
    convert_refused(src, tmp_path, saver="llama_mistral", culprits=(f"{IT}/.metadata", "not listed in integrity.json"))


@pytest.mark.parametrize("name", ["../secret.txt", "/etc/passwd", "..", "sub/dir"])
def test_manifest_entry_leading_out(newer_sources, tmp_path, outside, name):
    src = fresh(newer_sources["torch_dist_integrity"], tmp_path)
    _edit_manifest(src, lambda files: files.update({name: "0" * 64}))
    convert_refused(src, tmp_path, saver="llama_mistral", culprits=(repr(name), "not a file name inside"))


@pytest.mark.parametrize("form", ["upper", "md5", "short"])
def test_manifest_digest_in_another_form(newer_sources, tmp_path, form):
    """Was reported as a corrupt .metadata ("the file was changed after saving"): the manifest is what is wrong."""
    src = fresh(newer_sources["torch_dist_integrity"], tmp_path)
    change = {"upper": str.upper, "md5": lambda d: d[:32], "short": lambda d: d[:8]}[form]
    _edit_manifest(src, lambda files: files.update({".metadata": change(files[".metadata"])}))
    convert_refused(src, tmp_path, saver="llama_mistral", culprits=("integrity.json", "'.metadata'",
                                                                    "not a SHA-256"))


def test_metadata_json_changed_under_an_intact_manifest(newer_sources, tmp_path):
    """metadata.json picks the reader: it was believed (here: zarr, and an unrelated error) before verification."""
    src = fresh(newer_sources["torch_dist_integrity"], tmp_path)
    (src / IT / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    convert_refused(src, tmp_path, saver="llama_mistral", culprits=(f"{IT}/metadata.json", "does not match",
                                                                    "integrity.json"))


# -- torch_dcp / fsdp_dtensor ------------------------------------------------------------------------------------------


def _rename(state: dict, old: str, new: str) -> None:
    for key in [k for k in state if k.startswith(old)]:
        state[new + key[len(old):]] = state.pop(key)


DCP_DAMAGE = [
    ("no args", "torch_dcp", lambda s: s.pop("args"), ("without Megatron's `args` entry",)),
    ("args not a namespace", "torch_dcp", lambda s: s.update(args=[1, 2]), ("args lack 'hidden_size'",)),
    ("foreign prefix", "torch_dcp", lambda s: _rename(s, "model.", "modle."), ("under one prefix", "found none")),
    ("unknown wrapper", "torch_dcp", lambda s: _rename(s, "model.", "model.wrapper."),
     ("no model.embedding.word_embeddings.weight",)),
    ("model twice, at two wrapper depths", "torch_dcp",
     lambda s: s.update({"model.module." + k[len("model."):]: v for k, v in list(s.items()) if k.startswith("model.")}),
     ("under one prefix", "'model.', 'model.module.'")),
    ("one tensor at another depth", "fsdp_dtensor",
     lambda s: s.update({"model.decoder.final_layernorm.weight": s["model.module.decoder.final_layernorm.weight"]}),
     ("under one prefix", "'model.', 'model.module.'")),
    ("misshapen qkv", "torch_dcp", lambda s: s.update({"model.decoder.layers.0.self_attention.linear_qkv.weight":
                                                        torch.zeros(64, 64)}),
     ("model.decoder.layers.0.self_attention.linear_qkv.weight [64, 64]", "the config implies")),
    ("an expert's half missing", "fsdp_dtensor",
     lambda s: s.pop("model.module.decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight_v"),
     ("Missing tensors", "local_experts.0.linear_fc1.weight_v")),
    ("halves and the whole", "fsdp_dtensor",
     lambda s: s.update({"model.module.decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": torch.zeros(
         192, 64)}), ("Extra tensors", "local_experts.0.linear_fc1.weight.")),
]


@pytest.mark.parametrize("what,name,edit,culprits", DCP_DAMAGE, ids=[w for w, *_ in DCP_DAMAGE])
def test_damaged_dcp_format(newer_sources, tmp_path, what, name, edit, culprits):
    src = fresh(newer_sources[name], tmp_path)
    edit_dcp(src / IT, edit)
    convert_refused(src, tmp_path, saver="hf", culprits=culprits)


# -- singleton_local_shards --------------------------------------------------------------------------------------------


def _as_singleton(state: dict) -> dict:
    """The stacked torch_dist entries of a MoE model as singleton_local_shards keeps them: each layer under its number,
    each expert under its own key, SwiGLU's fc1 as its `_w` (gate) and `_v` (up) halves."""
    out = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or "_extra_state" in key:
            continue
        if not key.startswith("decoder.layers."):
            out[key] = value
            continue
        rest = key[len("decoder.layers."):]
        for L in range(value.shape[0]):
            if not rest.startswith("mlp.experts.experts."):
                out[f"decoder.layers.{L}.{rest}"] = value[L].clone()
                continue
            module = rest[len("mlp.experts.experts."):]
            for E in range(value.shape[1]):
                base = f"decoder.layers.{L}.mlp.experts.experts.{E}.{module}"
                if module == "linear_fc1.weight":
                    gate, up = value[L, E].chunk(2)
                    out[base + "_w"], out[base + "_v"] = gate.clone(), up.clone()
                else:
                    out[base] = value[L, E].clone()
    return out


EXPERT = "decoder.layers.2.mlp.experts.experts.1.linear_fc1.weight"
SINGLETON_DAMAGE = [
    ("control", lambda s: None, ()),
    ("gate half missing", lambda s: s.pop(EXPERT + "_w"), ("Missing tensors", EXPERT + "_w")),
    ("both halves missing", lambda s: [s.pop(EXPERT + h) for h in ("_w", "_v")],
     ("Missing tensors", EXPERT + "_v", EXPERT + "_w")),
    ("halves and the whole", lambda s: s.update({EXPERT: torch.cat([s[EXPERT + "_w"], s[EXPERT + "_v"]])}),
     ("Extra tensors", EXPERT + ".")),
    ("a short up half", lambda s: s.update({EXPERT + "_v": s[EXPERT + "_v"][:5].clone()}),
     (EXPERT + "_v [5, 64]", "the config implies [96, 64]")),
    ("a fifth expert", lambda s: s.update({k.replace(".experts.1.", ".experts.4."): v.clone()
                                           for k, v in list(s.items())
                                           if k.startswith("decoder.layers.2.mlp.experts.experts.1.")}),
     ("Extra tensors", "decoder.layers.2.mlp.experts.experts.4.linear_fc1.weight_v")),
]


@pytest.mark.parametrize("what,edit,culprits", SINGLETON_DAMAGE, ids=[w for w, *_ in SINGLETON_DAMAGE])
def test_singleton_local_shards(newer_sources, tmp_path, what, edit, culprits):
    src = fresh(newer_sources["mixtral_dist"], tmp_path)

    def rewrite(state):
        singleton = _as_singleton(state)
        edit(singleton)
        state.clear()
        state.update(singleton)

    edit_dcp(src / IT, rewrite)
    if what == "control":  # the crafted layout is one the loader reads: the damage is what gets refused
        out = tmp_path / "ok"
        assert "singleton_local_shards=True" in cli("inspect", src, "--no-tensors")
        cli("--saver", "mixtral_hf", "--load-dir", src, "--save-dir", out, "-q")
        return
    convert_refused(src, tmp_path, saver="mixtral_hf", culprits=culprits)
