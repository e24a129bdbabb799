"""What a new user ran into with `mconvert` (issue 28): compare after an exact round trip whose tokenizer names a
token config.json leaves null, a missing local path taken for a hub id, savers that do not name the right saver,
DeepSeek's explicit null token ids, replicated tensors shown as TP pieces, `--json` and `--version`."""

from __future__ import annotations

import json
import shutil

from mconvert import engine
from mconvert.options import Options
from tests.support.cli import run_cli
from tests.support.models import make_deepseek, make_hf_model


def _name_a_pad_token(src):
    """A Qwen-like release: tokenizer_config.json names a pad token, config.json leaves pad_token_id null."""
    cfg = json.loads((src / "tokenizer_config.json").read_text()) | {"pad_token": "t0"}
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert json.loads((src / "config.json").read_text()).get("pad_token_id") is None


def test_compare_after_an_exact_round_trip_notes_token_ids_filled_from_the_tokenizer(tmp_path):
    src = make_hf_model(tmp_path / "src", "qwen2", seed=3)
    _name_a_pad_token(src)
    run_cli("--saver", "qwen_hf", "--load-dir", src, "--save-dir", tmp_path / "back", "-q")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["pad_token_id"] == 0  # filled by the saver
    out = run_cli("compare", src, tmp_path / "back")
    assert "note: config pad_token_id: A's config leaves it unset and its tokenizer names 0, the value B holds" in out
    assert out.rstrip().endswith("tensors bit-identical")
    result = json.loads(run_cli("compare", "--json", tmp_path / "back", src))
    assert result["same"] and result["config"] == [] and len(result["notes"]) == 1
    assert result["identical"] == len(result["tensors"]) and set(result["tensors"].values()) == {None}


def test_compare_still_fails_on_a_token_id_the_tokenizer_does_not_name(tmp_path):
    src = make_hf_model(tmp_path / "src", "qwen2", seed=3)
    _name_a_pad_token(src)
    other = tmp_path / "other"
    shutil.copytree(src, other)
    (other / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text()) | {"pad_token_id": 5}))
    out = run_cli("compare", src, other, expect_error=True)
    assert "config pad_token_id: A=None B=5" in out and "checkpoints differ" in out
    result = json.loads(run_cli("compare", "--json", src, other, expect_error=True))
    assert result["config"] == [{"field": "pad_token_id", "a": None, "b": 5}] and not result["same"]


def test_a_missing_local_path_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    out = run_cli("--saver", "core", "--load-dir", "runs/missing", "--save-dir", "out", expect_error=True)
    assert "runs/missing: no such" in out and "hub" not in out and "Traceback" not in out
    out = run_cli("--saver", "core", "--load-dir", "someorg/missing", "--save-dir", "out", expect_error=True)
    assert "hf download someorg/missing" in out and "huggingface-cli" not in out


def test_deepseek_keeps_an_explicit_null_bos_token_id(tmp_path):
    src = make_deepseek(tmp_path / "src")
    (src / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text()) | {"bos_token_id": None}))
    assert engine.load(src, Options()).config.bos_token_id is None  # not transformers' default 0
    run_cli("--saver", "deepseek_hf", "--load-dir", src, "--save-dir", tmp_path / "back", "-q")
    # the saver fills it from the tokenizer (which names t1 its bos), and compare says so rather than failing
    assert "note: config bos_token_id: A's config leaves it unset and its tokenizer names 1" in run_cli(
        "compare", src, tmp_path / "back")


def test_inspect_json_tells_replicated_copies_from_tp_pieces(llama_dir, tmp_path):
    run_cli("--saver", "core", "--tp", "2", "--load-dir", llama_dir, "--save-dir", tmp_path / "tp2", "-q")
    report = json.loads(run_cli("inspect", "--json", "--no-values", tmp_path / "tp2"))
    origins = {t["name"]: t["origin"] for t in report["tensors"]}
    assert origins["layers.0.attn_norm.weight"].endswith("(+1 TP copies)")  # the same tensor on both ranks
    assert origins["layers.0.attn.o.weight"].endswith("(+1 TP pieces)")  # halves of it
    assert report["layout"]["tp"] == 2 and report["config"]["num_layers"] == 4 and "non_finite" not in report
    text = run_cli("inspect", "--no-tensors", tmp_path / "tp2")
    assert "values:      all finite" in text and "tensors (" not in text


def test_version():
    assert run_cli("--version").startswith("mconvert, version ")
    from tests.support.cli import mtrain
    assert mtrain("--version").startswith("mtrain, version ")


def test_the_saver_of_another_family_names_the_right_one(tmp_path):
    src = make_hf_model(tmp_path / "src", "qwen3", seed=1)
    out = run_cli("--saver", "llama_mistral", "--load-dir", src, "--save-dir", tmp_path / "out", expect_error=True)
    assert "the llama_mistral saver cannot write a qwen3 model; use --saver qwen_hf" in out
