"""NaN and infinite weights: conversion carries them, `inspect` reports them, `compare` of a checkpoint with itself
(or with its conversion) says identical, NaN equal to NaN in the same place."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.refusals import cli, fresh


@pytest.fixture
def with_nan(sources, tmp_path):
    src = fresh(sources["llama_mistral"], tmp_path, "nan")
    weights = load_file(src / "model.safetensors")
    weights["model.embed_tokens.weight"][3, 5] = float("nan")
    weights["model.embed_tokens.weight"][7, 1] = float("nan")
    weights["lm_head.weight"][0, 0] = float("inf")
    weights["model.norm.weight"][2] = float("-inf")
    save_file(weights, src / "model.safetensors")
    return src


def test_inspect_reports_non_finite_values(with_nan, tmp_path):
    out = cli("inspect", with_nan)
    assert "values:      non-finite values in 3 of 39 tensors: embed.weight (2 NaN), final_norm.weight (1 Inf), " \
           "lm_head.weight (1 Inf)" in out
    assert "[2 NaN]" in out
    core = tmp_path / "core"
    cli("--saver", "core", "--tp", "2", "--load-dir", with_nan, "--save-dir", core, "-q")  # carried, not refused
    assert "non-finite values in 3 of 39 tensors" in cli("inspect", core, "--no-tensors")


def test_inspect_of_a_finite_checkpoint(sources):
    assert "values:      all finite" in cli("inspect", sources["core"], "--no-tensors")
    assert "values:" not in cli("inspect", sources["core"], "--no-tensors", "--no-values")


def test_compare_with_itself_and_with_its_conversion(with_nan, tmp_path):
    out = cli("compare", with_nan, with_nan)
    assert "39/39 tensors bit-identical" in out and "differ" not in out
    cli("--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", with_nan, "--save-dir", tmp_path / "core", "-q")
    assert "39/39 tensors bit-identical" in cli("compare", with_nan, tmp_path / "core")


def test_compare_sees_nan_moved(with_nan, tmp_path):
    other = fresh(with_nan, tmp_path, "moved")
    weights = load_file(other / "model.safetensors")
    weights["model.embed_tokens.weight"][7, 1] = 0.5
    weights["model.embed_tokens.weight"][8, 1] = float("nan")
    save_file(weights, other / "model.safetensors")
    out = cli("compare", with_nan, other, expect_error=True)
    assert "embed.weight: differs: NaN in different places (2 in A, 2 in B)" in out
    assert "38/39 tensors bit-identical; checkpoints differ" in out


def test_compare_sees_a_value_beside_nan(with_nan, tmp_path):
    other = fresh(with_nan, tmp_path, "changed")
    weights = load_file(other / "model.safetensors")
    weights["model.embed_tokens.weight"][0, 0] += 1.0
    save_file(weights, other / "model.safetensors")
    out = cli("compare", with_nan, other, expect_error=True)
    assert "embed.weight: differs, max |diff| 1" in out
    assert not torch.isnan(torch.tensor(float(out.split("max |diff| ")[1].split()[0])))
