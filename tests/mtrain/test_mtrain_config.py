"""The typed configuration: files in three formats, command-line overrides, and exact error messages."""

from __future__ import annotations

import json

import pytest

from mtrain.config import dump, load_config
from mtrain.errors import TrainError

YAML = """
model: {family: llama, num_layers: 2, hidden_size: 32, ffn_hidden_size: 64, num_attention_heads: 4,
        num_query_groups: 2, head_dim: 8, vocab_size: 64, max_position_embeddings: 64}
data: {paths: [a_text_document], seq_len: 32}
train: {steps: 10, micro_batch_size: 2, global_batch_size: 8}
"""


def test_file_plus_overrides(tmp_path):
    (tmp_path / "run.yaml").write_text(YAML)
    c = load_config(tmp_path / "run.yaml", ["--train.steps", "20", "--optim.lr=3e-4", "--data.paths", "x,y",
                                            "--data.weights", "[0.3, 0.7]", "--train.deterministic", "true",
                                            "--train.precision", "bf16", "--checkpoint.dir", "ckpt",
                                            "--model.rope_scaling", "{rope_type: linear, factor: 2.0}"])
    assert c.train.steps == 20 and c.train.micro_batch_size == 2
    assert c.optim.lr == 3e-4 and isinstance(c.optim.lr, float)
    assert c.data.paths == ("x", "y") and c.data.weights == (0.3, 0.7)
    assert c.train.deterministic is True and c.train.precision == "bf16"
    assert c.checkpoint.dir == "ckpt" and c.model.hidden_size == 32
    assert c.model.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    text = dump(c)
    assert "steps: 20" in text and "lr: 0.0003" in text and "hidden_size: 32" in text


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_toml_and_json_files(tmp_path, suffix):
    if suffix == ".toml":
        pytest.importorskip("tomllib")
        text = '[train]\nsteps = 7\nmicro_batch_size = 1\nglobal_batch_size = 4\n[data]\npaths = ["p"]\n'
    else:
        text = json.dumps({"train": {"steps": 7, "micro_batch_size": 1, "global_batch_size": 4},
                           "data": {"paths": ["p"]}})
    (tmp_path / f"run{suffix}").write_text(text)
    c = load_config(tmp_path / f"run{suffix}")
    assert (c.train.steps, c.train.global_batch_size, c.data.paths, c.model) == (7, 4, ("p",), None)


def error(*overrides, text=None, tmp_path=None) -> str:
    path = None
    if text is not None:
        path = tmp_path / "run.yaml"
        path.write_text(text)
    with pytest.raises(TrainError) as e:
        load_config(path, list(overrides))
    return str(e.value)


def test_unknown_field():
    assert error("--train.lrr", "1") == (
        "unknown config field(s) train.lrr; valid fields of train: steps, micro_batch_size, global_batch_size, "
        "seed, precision, recompute, deterministic, init_std, exit_after_steps, compile, moe_capacity_factor, "
        "moe_router_bias_update_rate, mtp_loss_scaling_factor")


def test_unknown_field_in_a_file(tmp_path):
    msg = error(text="optim:\n  learning_rate: 0.1\n", tmp_path=tmp_path)
    assert msg.startswith("unknown config field(s) optim.learning_rate; valid fields of optim: lr, min_lr, ")


def test_unknown_section(tmp_path):
    assert error(text="trainer: {steps: 3}\n", tmp_path=tmp_path) == (
        "unknown config section(s): trainer; valid sections: model, data, train, optim, eval, checkpoint, "
        "parallel, logging")


def test_unknown_model_field(tmp_path):
    msg = error(text=YAML + "  \nmodel:\n  family: llama\n  hidden: 3\n", tmp_path=tmp_path)
    assert msg.startswith("unknown config field(s) model.hidden; valid fields of model: family, num_layers, ")


@pytest.mark.parametrize("override, message", [
    (["--train.steps", "many"], "train.steps: expected an integer, found 'many'"),
    (["--train.precision", "fp8"], "train.precision: 'fp8' is not one of fp32, bf16, auto"),
    (["--optim.lr", "fast"], "optim.lr: expected a number, found 'fast'"),
    (["--train.deterministic", "maybe"], "train.deterministic: expected true or false, found 'maybe'"),
    (["--train.global_batch_size", "6", "--train.micro_batch_size", "4"],
     "train.global_batch_size 6 is not a multiple of train.micro_batch_size 4"),
    (["--data.paths", "a,b", "--data.weights", "1"], "data.weights has 1 entries for 2 data.paths"),
    (["train.steps", "3"], "unexpected argument 'train.steps': overrides look like --section.field VALUE "
                           "(sections: model, data, train, optim, eval, checkpoint, parallel, logging)"),
    (["--train.steps"], "--train.steps needs a value"),
])
def test_bad_values(override, message):
    assert error(*override) == message


def test_model_section_checked_by_the_ir_config(tmp_path):
    assert error("--model.norm", "batchnorm", text=YAML, tmp_path=tmp_path) == (
        "model.norm: 'batchnorm' is not one of rmsnorm, layernorm")
    assert error("--model.num_query_groups", "3", text=YAML, tmp_path=tmp_path) == (
        "config section model: num_attention_heads=4 is not a multiple of num_query_groups=3 (key/value heads)")


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(TrainError, match=r"config file .*nope.yaml not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
    with pytest.raises(TrainError, match=r"config file .*bad.yaml is not valid YAML"):
        load_config(tmp_path / "bad.yaml")
