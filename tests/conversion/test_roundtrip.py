"""Every family's tiny HF model -> Megatron (each format that can hold it, at layouts of tests/support/layouts.py)
-> HF again: the same files bit for bit, the same config, the same logits in transformers.

On the way, the Megatron checkpoint is read back as the format and layout it was asked to be (rank folders named
as Megatron names them, stage sizes, module names, expert layout), with the source's config and IR tensors.
What each family has beyond this (its on-disk names, its refusals, its config.json spellings) is tested in its
own file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from mconvert import engine
from mconvert.ir.config import ModelConfig
from mconvert.options import Options
from tests.support.cli import run_cli
from tests.support.compare import assert_same_files, assert_same_hf_config, assert_same_tensors, hf_logits
from tests.support.layouts import DISTRIBUTED, LAYOUTS, Layout
from tests.support.models import FAMILIES

# family -> format -> layouts. Every family goes through every format that can hold it; the torch format, which
# holds every layout, through the layouts that family's features meet (GQA groups split by TP, uneven and virtual
# pipeline stages, experts split by EP and ETP in each expert layout, Transformer Engine names). Legacy holds
# neither experts nor per-head q/k norms, the DCP formats no MTP modules (test_legacy.py, test_qwen.py,
# test_deepseek.py, test_glm4_moe.py and test_gpt_oss.py check those refusals).
MATRIX = {
    "llama": {"torch": ("tp1", "tp2", "tp4", "tp1_pp2", "tp2_pp2", "tp1_pp3_first1_last1", "tp2_pp2_vpp2",
                        "tp2_pp2_te"),
              "torch_dist": ("tp1",), "zarr": ("tp1",), "torch_dcp": ("tp2", "tp2_te"),
              "fsdp_dtensor": ("tp2", "tp2_te"), "legacy": ("tp2_pp2_vpp2",)},
    "mistral": {"torch": ("tp4", "tp1_pp3_first1_last1", "tp2_pp2_vpp2", "tp2_pp2_te"),
                "torch_dist": ("tp2_te",), "zarr": ("tp2",), "torch_dcp": ("tp1",), "fsdp_dtensor": ("tp1_te",),
                "legacy": ("tp2",)},
    "gpt2": {"torch": ("tp2_pp2", "tp4", "tp1_pp2_vpp2", "tp2_te"),
             "torch_dist": ("tp1",), "zarr": ("tp1",), "torch_dcp": ("tp2",), "fsdp_dtensor": ("tp2",),
             "legacy": ("tp1", "tp2", "tp1_pp2", "tp2_pp2")},
    # each expert layout at two parallel layouts, each parallel layout with two expert layouts
    "mixtral": {"torch": ("tp1", "tp1_legacy_grouped", "tp2_ep2_te", "tp2_ep2_te_grouped", "tp1_ep4_pp2_te_grouped",
                          "tp1_ep4_pp2_legacy_grouped", "tp2_pp2", "tp2_pp2_te"),
                "torch_dist": ("tp1",), "zarr": ("tp1",), "torch_dcp": ("tp2", "tp2_te_grouped"),
                "fsdp_dtensor": ("tp2", "tp2_te_grouped")},
    "qwen2": {"torch": ("tp2_pp2", "tp1_pp3_first1_last1", "tp2_te"),
              "torch_dist": ("tp1",), "zarr": ("tp2_te",), "torch_dcp": ("tp2",), "fsdp_dtensor": ("tp1",),
              "legacy": ("tp2_pp2",)},
    "qwen3": {"torch": ("tp2_pp2_vpp2_te", "tp4"),
              "torch_dist": ("tp2_te",), "zarr": ("tp1",), "torch_dcp": ("tp2_te",), "fsdp_dtensor": ("tp2",)},
    "qwen3_moe": {"torch": ("tp2_ep2_pp2", "tp2_ep2_te_grouped", "tp2_etp1_pp2_vpp2_legacy_grouped",
                            "tp1_ep4_pp2_first1_te"),
                  "torch_dist": ("tp1",), "zarr": ("tp1_te",), "torch_dcp": ("tp1",), "fsdp_dtensor": ("tp1",)},
    # sandwich norms (Megatron-Bridge's names under both specs), windows over uneven stages; legacy refuses it
    # (test_gemma3.py)
    "gemma3_text": {"torch": ("tp2_pp2", "tp1_pp3_first1_last1", "tp2_pp2_vpp2_te"),
                    "torch_dist": ("tp2_te",), "zarr": ("tp1",), "torch_dcp": ("tp2",), "fsdp_dtensor": ("tp2_te",)},
    "deepseek_v3": {"torch": ("tp2", "tp2_te", "tp2_ep2_etp1_pp3", "tp2_ep2_pp3_te", "tp1_ep4_te_grouped",
                              "tp2_pp2_first1_legacy_grouped", "tp1_ep2_pp2_last1_te"),
                    "torch_dist": ("tp1", "tp2_te"), "zarr": ("tp1_te",)},
    # the DCP formats hold no MTP modules (test_glm4_moe.py: refused, and the rest with --skip-mtp)
    "glm4_moe": {"torch": ("tp2_ep2_pp2", "tp2_ep2_pp2_vpp2_te", "tp1_ep4_te_grouped", "tp2_etp1_pp2_legacy_grouped"),
                 "torch_dist": ("tp1", "tp2_te"), "zarr": ("tp1_te",)},
    # sinks split with the heads, expert biases with their experts (legacy holds no experts: test_gpt_oss.py)
    "gpt_oss": {"torch": ("tp2_ep2_pp2", "tp2_ep2_te_grouped", "tp2_ep2_pp2_vpp2_te", "tp2_pp2_vpp2_te"),
                "torch_dist": ("tp1", "tp2_te"), "zarr": ("tp1",), "torch_dcp": ("tp2",),
                "fsdp_dtensor": ("tp2_te_grouped",)},
}
# IR config fields a Megatron checkpoint does not hold as the HF source has them (besides the padded vocabulary)
# (DeepSeek and GLM: HF has no coefficient; Megatron's args say 0.0)
NOT_IN_MEGATRON = {"deepseek_v3": ("moe_aux_loss_coeff",), "glm4_moe": ("moe_aux_loss_coeff",)}


def cases() -> list:
    return [pytest.param(family, fmt, name, id=f"{family}-{fmt}-{name}")
            for family, formats in MATRIX.items() for fmt, names in formats.items() for name in names]


@dataclass(frozen=True)
class Source:
    """A family's shared HF model, and what the round trips compare with, read once."""

    path: Path
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    logits: torch.Tensor  # transformers', on `tokens`


@pytest.fixture(scope="module")
def sources(hf_model, tokens) -> Callable[[str], Source]:
    read: dict[str, Source] = {}

    def get(family: str) -> Source:
        if family not in read:
            path = hf_model(family)
            ir = engine.load(path, Options())
            read[family] = Source(path, ir.config, {n: t.load() for n, t in ir}, hf_logits(path, tokens))
        return read[family]

    return get


@pytest.mark.parametrize("family, fmt, name", cases())
def test_hf_to_megatron_to_hf(family, fmt, name, sources, tokens, tmp_path):
    src, layout = sources(family), LAYOUTS[name]
    run_cli("--loader", FAMILIES[family].plugin, *layout.saver_args(fmt), "--load-dir", src.path,
            "--save-dir", tmp_path / "megatron")
    assert_megatron(tmp_path / "megatron", fmt, layout, src, family)
    run_cli("--loader", "legacy" if fmt == "legacy" else "core", "--saver", "hf", "--load-dir", tmp_path / "megatron",
            "--save-dir", tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(p.name for p in src.path.iterdir())
    assert_same_files(src.path, tmp_path / "hf")
    assert_same_hf_config(src.path, tmp_path / "hf")
    assert torch.equal(hf_logits(tmp_path / "hf", tokens), src.logits)


def assert_megatron(path: Path, fmt: str, layout: Layout, src: Source, family: str) -> None:
    """The checkpoint at `path` reads back as `fmt` in `layout`, with the config and tensors of `src`."""
    ir = engine.load(path, Options())
    assert ir.source.format == ("legacy (Megatron-LM legacy GPT)" if fmt == "legacy" else f"core (Megatron {fmt})")
    read = ir.source.layout
    if fmt in DISTRIBUTED:  # one set of files for any layout: no rank folders
        assert not list((path / "iter_0000001").glob("mp_rank_*"))
        has_metadata = fmt in ("torch_dist", "zarr")  # megatron-core's dist_checkpointing names its backend there
        assert (path / "iter_0000001" / "metadata.json").exists() == has_metadata
        if has_metadata:
            assert json.loads((path / "iter_0000001" / "metadata.json").read_text())["sharded_backend"] == fmt
        if fmt in ("torch_dcp", "fsdp_dtensor"):
            assert read["transformer_impl"] == layout.impl
    else:
        assert sorted(d.name for d in (path / "iter_0000001").glob("mp_rank_*")) == layout.rank_dirs
        want = {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp}
        if fmt == "torch":
            want |= {"ep": layout.ep, "transformer_impl": layout.impl}
            if ir.config.num_experts:
                want |= {"expert_layout": layout.experts, "etp": layout.etp or layout.tp}
        assert {k: read.get(k) for k in want} == want
        stages = read["stage_layers"]  # layers per pipeline stage
        assert len(stages) == layout.pp
        if layout.first:
            assert stages[0] == layout.first
        if layout.last:
            assert stages[-1] == layout.last
    unheld = dict.fromkeys(NOT_IN_MEGATRON.get(family, ()))
    assert ir.config.replace(padded_vocab_size=None, **unheld) == src.config.replace(**unheld)
    assert_same_tensors(src.tensors, {n: t.load() for n, t in ir})
