"""What a new user ran into with `mtrain` (issue 28): the tokenizer of a finetune from an HF directory, model
overrides on finetune, preprocess's silence and its error for a directory without a tokenizer."""

from __future__ import annotations

import json

import pytest
import yaml

from mtrain import checkpoint, inference
from mtrain.cli import _preprocess_progress
from mtrain.config import from_dict
from mtrain.data import preprocess as preprocess_module
from mtrain.data.preprocess import PreprocessConfig, preprocess
from mtrain.train import Trainer
from tests.support.cli import mtrain, run_cli
from tests.support.corpus import write_corpus, write_tokenizer
from tests.support.launch import launch, with_sections
from tests.support.models import TINY_MIXTRAL, save_hf
from tests.support.training import RUN, tiny_config

TOKENIZER = {"tokenizer.json", "tokenizer_config.json"}


def test_a_finetune_from_an_hf_directory_carries_its_tokenizer(corpus, tmp_path):  # noqa: F811
    """data.tokenizer unset: the run takes the HF directory's tokenizer, records where it came from, keeps it on
    resume, and generate, evaluate --lambada and the HF export find it."""
    hf = save_hf("llama", tmp_path / "hf", seed=4)
    args = ["finetune", "--load", hf, "--data.paths", corpus, "--checkpoint.dir", tmp_path / "run", *RUN]
    out = mtrain(*args, "--train.steps", "1")
    assert f"tokenizer: tokenizer.json, tokenizer_config.json from the checkpoint {hf} (copied into checkpoints)" in out
    step = tmp_path / "run" / "step_0000001"
    assert TOKENIZER <= {p.name for p in (step / "tokenizer").iterdir()}
    assert checkpoint.read_meta(step)["tokenizer_from"] == f"the checkpoint {hf}"
    assert (step / "tokenizer" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()

    mtrain(*args, "--train.steps", "2")  # resumed: the tokenizer travels on, though step 1 may be deleted
    step2 = tmp_path / "run" / "step_0000002"
    assert (step2 / "tokenizer" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert checkpoint.read_meta(step2)["tokenizer_from"] == f"the checkpoint {hf}"

    text = mtrain("generate", "--load", tmp_path / "run", "--prompt", "t5 t9", "--max-new-tokens", "2", "--greedy")
    assert text.startswith("t5 t9 t")
    (tmp_path / "lambada.jsonl").write_text(json.dumps({"text": "t5 t9 t3 t7"}) + "\n")
    out = mtrain("evaluate", "--load", tmp_path / "run", "--lambada", tmp_path / "lambada.jsonl")
    assert "last-word accuracy" in out
    run_cli("--saver", "llama_mistral", "--load-dir", tmp_path / "run", "--save-dir", tmp_path / "exported", "-q")
    assert (tmp_path / "exported" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()


def test_data_tokenizer_without_tokenizer_files_is_refused(corpus, tmp_path):  # noqa: F811
    hf = save_hf("llama", tmp_path / "hf", seed=4)
    (tmp_path / "empty").mkdir()
    out = mtrain("finetune", "--load", hf, "--data.paths", corpus, "--data.tokenizer", tmp_path / "empty",
                 "--train.steps", "1", *RUN, expect_error=True)
    assert f"Error: data.tokenizer {tmp_path}/empty: holds no tokenizer files" in out


def test_generate_looks_for_a_tokenizer_before_loading_the_model(tmp_path, monkeypatch):
    hf = save_hf("llama", tmp_path / "hf", seed=4)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (hf / name).unlink(missing_ok=True)

    def no_model(ir):
        raise AssertionError("the model was loaded before the tokenizer was checked")

    monkeypatch.setattr(inference, "model_of", no_model)
    out = mtrain("generate", "--load", hf, "--prompt", "t5", expect_error=True)
    assert f"Error: {hf} carries no tokenizer files: pass --tokenizer DIR (or give --tokens IDS)" in out


def test_a_finetune_changes_what_may_change_and_refuses_shapes(corpus, tmp_path):  # noqa: F811
    hf = save_hf("mixtral", tmp_path / "hf", seed=1)
    mtrain("finetune", "--load", hf, "--data.paths", corpus, "--train.steps", "1", "--checkpoint.dir",
           tmp_path / "run", "--model.moe_aux_loss_coeff", "0.5", "--model.max_position_embeddings", "128", *RUN)
    config = checkpoint.read_meta(tmp_path / "run" / "step_0000001")["model_config"]
    assert (config["moe_aux_loss_coeff"], config["max_position_embeddings"]) == (0.5, 128)
    assert config["num_experts"] == 4  # the rest is the checkpoint's
    out = mtrain("finetune", "--load", hf, "--data.paths", corpus, "--train.steps", "1", "--model.num_experts", "8",
                 "--model.moe_aux_loss_coeff", "0.5", *RUN, expect_error=True)
    assert f"Error: model.num_experts (4 in the checkpoint, 8 given): cannot change in a finetune of {hf}" in out
    out = mtrain("finetune", "--load", hf, "--data.paths", corpus, "--model.no_such_field", "1", *RUN,
                 expect_error=True)
    assert "unknown config field(s) model.no_such_field" in out


def test_preprocess_reports_progress(tmp_path, monkeypatch):
    write_tokenizer(tmp_path / "tok")
    write_corpus(tmp_path / "c.jsonl", documents=30)
    monkeypatch.setattr(preprocess_module, "PROGRESS_EVERY", 7)
    seen = []
    preprocess(PreprocessConfig(input=tmp_path / "c.jsonl", output_prefix=str(tmp_path / "out" / "c"),
                                tokenizer=tmp_path / "tok"), progress=seen.append)
    size = (tmp_path / "c.jsonl").stat().st_size
    assert [p.documents for p in seen] == [7, 14, 21, 28, 30] and [p.done for p in seen] == [False] * 4 + [True]
    assert all(a.bytes_read < b.bytes_read and a.tokens < b.tokens for a, b in zip(seen, seen[1:]))
    assert seen[-1].bytes_read == seen[-1].total_bytes == size
    lines = []
    monkeypatch.setattr("click.echo", lambda text, err=False: lines.append((text, err)))
    report = _preprocess_progress(every=0)  # every report shown
    for p in seen:
        report(p)
    assert len(lines) == 5 and all(err for _, err in lines)
    assert lines[-1][0].startswith(f"preprocess: 30 documents, {seen[-1].tokens:,} tokens, ")
    assert "(100%)" in lines[-1][0] and "MB/s" in lines[-1][0]


@pytest.mark.parametrize("what", ["empty", "model_dir"])
def test_preprocess_with_a_directory_without_a_tokenizer(tmp_path, what):
    write_corpus(tmp_path / "c.jsonl", documents=3)
    folder = tmp_path / what
    folder.mkdir()
    if what == "model_dir":
        (folder / "config.json").write_text("{}")
    out = mtrain("preprocess", "--input", tmp_path / "c.jsonl", "--output-prefix", tmp_path / "x",
                 "--tokenizer", folder, expect_error=True)
    assert f"Error: {folder}: holds no tokenizer files" in out and "sentencepiece or tiktoken" not in out


def _aux_losses(lines: list[str]) -> dict[int, float]:
    """step -> the aux loss its progress line shows (printed to 4 decimals)."""
    out = {}
    for line in lines:
        if line.startswith("step ") and " | aux loss " in line:
            out[int(line.split()[1].split("/")[0])] = float(line.split(" | aux loss ")[1].split()[0])
    return out


@pytest.mark.parity
def test_multi_rank_runs_log_the_one_process_aux_loss_and_print_no_warnings(corpus, tmp_path):  # noqa: F811
    """Two gloo ranks under data, expert and context parallel (MoE, 3 steps) log the aux loss one process logs,
    and print no warning (PyTorch deprecations our code triggered: slicing a flattened mesh dim from the root,
    torch.distributed.nn's all_reduce, reading torch.distributed.reduce_op at the end).

    The bound: the logged value is the mean of each (layer, micro-batch) load-balancing loss over the step, each
    computed from the same tokens and weights whatever the layout; the weights of steps 2-3 differ from one
    process's by float32 reorderings (relative ~1e-7, so ~1e-6 on a loss near 2), and each printed value is rounded
    to 4 decimals (within 5e-5): 1e-4 + 1e-5. Before, each rank logged its last micro-batch's loss (0.02 apart)."""
    raw = tiny_config(corpus, model=TINY_MIXTRAL, train={"steps": 3}, logging={"interval": 1}).to_dict()
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    spec = [
        {"cli": ["pretrain", "--config", str(tmp_path / "run.yaml"), "--parallel.ep", "2"]},
        {"config": with_sections(raw, parallel={"dp_mode": "fsdp"}), "out": str(tmp_path / "dp.json")},
        {"config": with_sections(raw, parallel={"cp": 2}), "out": str(tmp_path / "cp.json")},
    ]
    proc = launch(spec, tmp_path)
    assert [line for line in proc.stderr.splitlines() if "Warning" in line] == []
    lines: list[str] = []
    Trainer(from_dict(raw), out=lines.append).run()
    one = _aux_losses(lines)
    assert sorted(one) == [1, 2, 3]
    for name in ("dp", "cp"):
        got = _aux_losses(json.loads((tmp_path / f"{name}.json").read_text())["lines"])
        assert got.keys() == one.keys() and all(abs(got[s] - one[s]) <= 1e-4 + 1e-5 for s in one), (name, got, one)
    ep = _aux_losses(proc.stderr.splitlines())  # the command line's progress lines (rank 0 prints, on stderr)
    assert ep.keys() == one.keys() and all(abs(ep[s] - one[s]) <= 1e-4 + 1e-5 for s in one), (ep, one)


def test_finetune_help_tells_of_overrides_and_the_tokenizer():
    text = " ".join(mtrain("finetune", "--help").split())
    assert "Any config field can be set on the command line: --optim.lr 2e-5" in text
    assert "--model.FIELD changes the checkpoint's config where a finetune may (moe_aux_loss_coeff," in text
    assert "The tokenizer is data.tokenizer, else the checkpoint's" in text
