"""Refusals that must be one `Error:` line and a non-zero exit, never a traceback: configs of nested YAML aliases,
non-UTF-8 or deeply nested configs and inputs, tokenizer files of the wrong JSON type, loops of symbolic links,
values too big to quote whole; and DeepSeek configs that contradict their tensors (`n_group: 0`, more MTP layers
announced than stored)."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest

from mtrain.data.tokenizer import load_tokenizer
from mtrain.errors import TrainError
from mtrain.tasks import read_passages
from tests.support.corpus import write_corpus, write_tokenizer
from tests.support.refusals import cli, convert_refused, fresh, mtrain_cli, refused

# 10 levels of 10 aliases: 10^9 strings once expanded, in under 500 bytes
BILLION_LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{n}: &{n} [{','.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))


def _one_error_line(out: str) -> None:
    lines = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, out


def test_yaml_config_of_nested_aliases(tmp_path):
    """Expanded, it holds 10^9 strings; any error quoting it would print them all. Aliases are refused as they are
    met, so the memory traced stays that of parsing 500 bytes (a bound of 8 MiB: one level expanded is already
    10^4 list entries, the second 10^5 and so on)."""
    path = tmp_path / "run.yaml"
    path.write_text("train: {steps: 0}\n")
    assert mtrain_cli("pretrain", "--config", path)[0] != 0  # the modules a run imports, imported before tracing
    path.write_text(BILLION_LAUGHS)
    assert len(BILLION_LAUGHS) < 500
    tracemalloc.start()
    try:
        code, out = mtrain_cli("pretrain", "--config", path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code != 0 and peak < 8 * 2**20, (peak, out)
    refused(out, f"config file {path} is not valid YAML", "YAML aliases (*a, line 2) are not accepted")
    _one_error_line(out)


@pytest.mark.parametrize("suffix", [".yaml", ".json", ".toml"])
def test_config_not_utf8(tmp_path, suffix):
    path = tmp_path / f"run{suffix}"
    path.write_bytes(b'train = {steps = "\xff\xfe"}\n' if suffix == ".toml" else b'{"train": {"steps": "\xff"}}\n')
    code, out = mtrain_cli("pretrain", "--config", path)
    assert code != 0
    refused(out, f"config file {path} is not UTF-8 text (byte 0xff at offset")


def test_config_nested_past_the_parser(tmp_path):
    path = tmp_path / "run.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    code, out = mtrain_cli("pretrain", "--config", path)
    assert code != 0
    refused(out, f"config file {path} is not valid JSON")
    _one_error_line(out)


def test_config_value_too_big_to_quote(tmp_path):
    """A 600 KB list where a number goes: the error quotes its first 80 characters and says how long it is."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"train": {"steps": list(range(100_000))}}))
    code, out = mtrain_cli("pretrain", "--config", path)
    assert code != 0
    refused(out, "train.steps: expected an integer, found [0, 1, 2, 3", "characters)")
    assert len(out) < 400, out


def test_config_a_loop_of_symbolic_links(tmp_path):
    os.symlink(tmp_path / "run.yaml", tmp_path / "run.yaml")
    code, out = mtrain_cli("pretrain", "--config", tmp_path / "run.yaml")
    assert code != 0
    refused(out, f"config file {tmp_path / 'run.yaml'} not found")


# -- mtrain preprocess --------------------------------------------------------------------------------------------

def _preprocess(tmp_path: Path, *extra) -> tuple[int, str]:
    if not (tmp_path / "tok").is_dir():
        write_tokenizer(tmp_path / "tok")
    return mtrain_cli("preprocess", "--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "out" / "c",
                      "--tokenizer", tmp_path / "tok", *extra)


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("line,said", [(b"[" * 100_000 + b"]" * 100_000, "line 3: JSON nested too deeply"),
                                       (b'{"text": "w3 \xff w4"}', "line 3: not UTF-8 text (byte 0xff at column 14)")])
def test_preprocess_input_line(tmp_path, workers, line, said):
    write_corpus(tmp_path / "in.jsonl", documents=2)
    with open(tmp_path / "in.jsonl", "ab") as f:
        f.write(line + b"\n")
    code, out = _preprocess(tmp_path, "--workers", workers)
    assert code != 0
    refused(out, f"{tmp_path / 'in.jsonl'}, {said}")
    _one_error_line(out)
    assert not list((tmp_path / "out").glob("*")), "output left behind"


@pytest.mark.parametrize("name,content,said", [
    ("tokenizer.json", "[1, 2]", "expected a JSON object, found list"),
    ("tokenizer.json", b'{"model": "\xff"}', "not readable JSON (UnicodeDecodeError"),
    ("tokenizer_config.json", '["<eos>"]', "expected a JSON object, found list"),
    ("tokenizer.json", '{"version": "1.0", "model": {"type": "BPE", "vocab": 7}}', "not a tokenizers tokenizer.json")])
def test_preprocess_tokenizer_file_of_the_wrong_type(tmp_path, name, content, said):
    write_tokenizer(tmp_path / "tok")
    write_corpus(tmp_path / "in.jsonl", documents=2)
    target = tmp_path / "tok" / name
    target.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, out = _preprocess(tmp_path)
    assert code != 0
    refused(out, f"{target}: {said}")


# -- mconvert ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,content,said", [
    ("tokenizer.json", "[1, 2]", "expected a JSON object, found list"),
    ("tokenizer.json", '{"model": [1]}', "model must be a JSON object, found list"),
    ("tokenizer.json", '{"model": {"vocab": {"a": 0}}, "added_tokens": [7]}', "added_tokens must be a list of"),
    ("tokenizer.json", '{"model": {"vocab": {"a": "zero"}}}', "model.vocab['a'] must be a token id"),
    ("tokenizer_config.json", '"<eos>"', "expected a JSON object, found str"),
    ("tokenizer_config.json", b'{"eos_token": "\xff"}', "not valid JSON: UnicodeDecodeError")])
def test_checkpoint_tokenizer_file_of_the_wrong_type(sources, tmp_path, name, content, said):
    src = fresh(sources["llama_mistral"], tmp_path)
    (src / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    convert_refused(src, tmp_path, saver="llama_mistral", culprits=(f"{src / name}: {said}",))


def test_config_json_not_utf8(sources, tmp_path):
    src = fresh(sources["llama_mistral"], tmp_path)
    (src / "config.json").write_bytes((src / "config.json").read_bytes().replace(b'"llama"', b'"ll\xe9ama"'))
    out = convert_refused(src, tmp_path, culprits=(f"{src / 'config.json'}: not valid JSON: UnicodeDecodeError",))
    _one_error_line(out)


@pytest.mark.parametrize("where", ["beside the weights", "the weights", "config.json"])
def test_checkpoint_holding_a_loop_of_symbolic_links(sources, tmp_path, where):
    src = fresh(sources["llama_mistral"], tmp_path)
    name = {"beside the weights": "x1", "the weights": "model.safetensors", "config.json": "config.json"}[where]
    (src / name).unlink(missing_ok=True)
    os.symlink(src / "x2" if name == "x1" else src / name, src / name)
    if name == "x1":
        os.symlink(src / "x1", src / "x2")
    out = cli("inspect", src, expect_error=True)
    refused(out, f"{src}/", "cannot follow it: a loop of symbolic links")
    convert_refused(src, tmp_path, culprits=("cannot follow it: a loop of symbolic links",))


def test_save_dir_a_loop_of_symbolic_links(sources, tmp_path):
    os.symlink(tmp_path / "out", tmp_path / "out")
    out = cli("--saver", "core", "--load-dir", sources["llama_mistral"], "--save-dir", tmp_path / "out", "-q",
              expect_error=True)
    refused(out, f"{tmp_path / 'out'}: cannot follow it: a loop of symbolic links")


# -- DeepSeek configs against their tensors ------------------------------------------------------------------------

def _edit_config(src: Path, **fields) -> None:
    config = json.loads((src / "config.json").read_text())
    config.update(fields)
    (src / "config.json").write_text(json.dumps(config))


def test_deepseek_n_group_zero(deepseek_sources, tmp_path):
    """0 groups was read as "no grouping" (the `or 1` of a missing value): a config that says 0 is refused."""
    src = fresh(deepseek_sources["deepseek_hf"], tmp_path)
    _edit_config(src, n_group=0)
    convert_refused(src, tmp_path, culprits=(f"{src / 'config.json'}", "n_group=0: expected a number of expert "
                                                                       "groups >= 1, or null"))


def test_deepseek_more_mtp_layers_announced_than_stored(deepseek_sources, tmp_path):
    """The fixture stores one MTP layer (model.layers.3); announcing 2 is a checkpoint missing one. (None stored
    at all is how transformers saves a model, and is converted with a note.)"""
    src = fresh(deepseek_sources["deepseek_hf"], tmp_path)
    _edit_config(src, num_nextn_predict_layers=2)
    convert_refused(src, tmp_path, culprits=(f"{src / 'config.json'}", "num_nextn_predict_layers=2",
                                             "the weights hold 1 MTP layer(s) (model.layers.3 to model.layers.3)"))


@pytest.mark.parametrize("line,said", [(b'{"text": "w3 \xff w4"}', ":3: not UTF-8 text (byte 0xff at column 14)"),
                                       (b"[" * 100_000 + b"]" * 100_000, ":3: expected a JSON object with a 'text'")])
def test_evaluation_task_file_line(tmp_path, line, said):
    path = tmp_path / "task.jsonl"
    path.write_bytes(b'{"text": "w3 w4 w5"}\n{"text": "w6 w7"}\n' + line + b"\n")
    with pytest.raises(TrainError) as e:
        read_passages(path, load_tokenizer(write_tokenizer(tmp_path / "tok")))
    assert str(e.value).startswith(f"{path}{said}")


def test_integrity_manifest_nested_past_the_parser(newer_sources, tmp_path):
    src = fresh(newer_sources["torch_dist_integrity"], tmp_path)
    manifest = next(src.glob("iter_*")) / "integrity.json"
    manifest.write_text("[" * 100_000 + "]" * 100_000)
    convert_refused(src, tmp_path, saver="hf", culprits=(f"{manifest}: not valid JSON",
                                                          "the integrity manifest is damaged"))
