"""The typed configuration: files in three formats, command-line overrides, and exact error messages."""

from __future__ import annotations

import json
from pathlib import Path

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
        "moe_router_bias_update_rate, mtp_loss_scaling_factor, cpu_malloc")


def test_unknown_field_in_a_file(tmp_path):
    msg = error(text="optim:\n  learning_rate: 0.1\n", tmp_path=tmp_path)
    assert msg.startswith("unknown config field(s) optim.learning_rate; valid fields of optim: lr, min_lr, ")


def test_unknown_section(tmp_path):
    assert error(text="trainer: {steps: 3}\n", tmp_path=tmp_path) == (
        "unknown config section(s): trainer; valid sections: model, data, train, optim, eval, checkpoint, "
        "parallel, logging, lora, mlm")


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
                           "(sections: model, data, train, optim, eval, checkpoint, parallel, logging, lora, mlm)"),
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


# -- command-line values: lists and null the same for every field --------------------------------------------------

def _fields_of_type(predicate):
    import dataclasses
    import typing

    from mtrain.config import SECTIONS

    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if predicate(hints[f.name]):
                yield section, f.name, hints[f.name]


def _is_optional(hint) -> bool:
    import types
    import typing

    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _list_item(hint):
    import typing

    for h in (hint, *typing.get_args(hint)):
        if typing.get_origin(h) in (tuple, list):
            return typing.get_args(h)[0]
    return None


MODEL = ["--model.family", "llama", "--model.num_layers", "2", "--model.hidden_size", "32", "--model.ffn_hidden_size",
         "64", "--model.num_attention_heads", "4", "--model.num_query_groups", "2", "--model.head_dim", "8",
         "--model.vocab_size", "64", "--model.max_position_embeddings", "64"]


def test_null_means_none_for_every_optional_field():
    optional = list(_fields_of_type(_is_optional))
    assert len(optional) > 20  # text, number, list and mapping fields alike
    for section, name, _ in optional:
        for spelling in ("null", "~"):
            c = load_config(None, MODEL + [f"--{section}.{name}", spelling])
            assert getattr(getattr(c, section), name) is None, (section, name, spelling)


def test_lists_parse_the_same_for_every_list_field():
    samples = {str: ("a", "b"), float: (0.7, 0.3), int: (3, 4)}
    lists = list(_fields_of_type(lambda h: _list_item(h) is not None))
    assert {(s, n) for s, n, _ in lists} >= {("data", "paths"), ("data", "weights"), ("model", "eos_token_id")}
    for section, name, hint in lists:
        want = {("lora", "targets"): ("q", "v")}.get((section, name)) or samples[_list_item(hint)]
        extra = {("data", "weights"): ["--data.paths", "p,q"],  # what makes each list valid
                 ("model", "dense_layers"): ["--model.num_layers", "6", "--model.num_experts", "4",
                                             "--model.moe_top_k", "2", "--model.moe_ffn_hidden_size", "32"],
                 ("model", "full_attention_layers"): ["--model.num_layers", "6"],
                 ("lora", "targets"): ["--lora.rank", "4"],
                 }.get((section, name), [])
        for text in (",".join(map(str, want)), "[" + ", ".join(map(str, want)) + "]"):
            c = load_config(None, MODEL + extra + [f"--{section}.{name}", text])
            assert tuple(getattr(getattr(c, section), name)) == want, (section, name, text)
    c = load_config(None, ["--data.paths", "a", "--data.weights", "1"])  # one item needs no comma
    assert c.data.paths == ("a",) and c.data.weights == (1.0,)


def test_text_fields_keep_the_text():
    c = load_config(None, ["--checkpoint.dir", "007", "--data.split", "98,2,0", "--data.tokenizer", "null_tok"])
    assert (c.checkpoint.dir, c.data.split, c.data.tokenizer) == ("007", "98,2,0", "null_tok")


# -- help and `mtrain config` ---------------------------------------------------------------------------------------

def test_every_field_has_one_line_of_meaning():
    import dataclasses

    from mtrain.config import SECTIONS
    from mtrain.config_doc import UNDOCUMENTED, field_help

    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            text = field_help(cls, f)  # a new ModelConfig field needs a line in config_doc.MODEL_HELP
            assert text and text != UNDOCUMENTED and "\n" not in text, (section, f.name)


def _mtrain(*args):
    from click.testing import CliRunner

    from mtrain.cli import main

    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_help_names_only_fields_that_exist():
    """Every `--section.field` that any help text shows is a real field (pretrain once showed --train.lr)."""
    import dataclasses
    import re

    from mtrain.cli import main
    from mtrain.config import SECTIONS, field_key

    real = {f"{s}.{field_key(f.name)}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    import mtrain.cli

    root = Path(__file__).resolve().parents[2]
    docs = [(root / name).read_text() for name in ("README.md", "docs/mtrain.md")]
    texts = [_mtrain("--help"), mtrain.cli.__doc__, *docs] + [_mtrain(name, "--help") for name in main.commands]
    shown = {m for text in texts for m in re.findall(r"--([a-z_]+\.[a-z_]+)", text)} - {"section.field"}
    assert shown and shown <= real, shown - real
    assert "optim.lr" in shown


def test_mtrain_config_lists_every_section_and_field():
    import dataclasses

    from mtrain.config import SECTIONS, field_key

    out = _mtrain("config")
    for section, cls in SECTIONS.items():
        assert f"\n{section}:  # " in out
        for f in dataclasses.fields(cls):
            assert f"\n  {field_key(f.name)}: " in out, f"{section}.{f.name}"
    assert "  seq_len: 1024                   # int: tokens per sample" in out
    assert "  precision: fp32                 # fp32 | bf16 | auto: " in out
    assert "  weights: null                   # list of float | null: " in out
    assert max(len(line) for line in out.splitlines()) <= 118


def test_mtrain_config_is_a_config_file(tmp_path):
    """The output loads back (once the required model fields are filled in) to the defaults."""
    import yaml

    from mtrain.config import Config

    raw = yaml.safe_load(_mtrain("config"))
    assert set(raw["model"]) and all(v is None for k, v in raw["model"].items() if k in ("family", "num_layers"))
    raw["model"] = None
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    assert load_config(tmp_path / "run.yaml") == Config()
    shown = _mtrain("config", "--config", str(tmp_path / "run.yaml"), "--train.steps", "5")
    assert "\n  steps: 5 " in shown


def test_the_guide_shows_what_mtrain_config_prints():
    readme = (Path(__file__).resolve().parents[2] / "docs" / "mtrain.md").read_text()
    begin = readme.index("<!-- mtrain config: begin")
    block = readme[readme.index("```yaml\n", begin) + len("```yaml\n"):readme.index("```\n<!-- mtrain config: end")]
    assert block == _mtrain("config")
