"""A LoRA run out of mtrain: the merged model for transformers, the adapters for PEFT, checked against the real
`peft` package; generate and evaluate read the run directly (its base with the adapters merged while loading)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mconvert.errors import ConvertError
from mconvert.hf import peft as peft_format
from mtrain.config import from_dict
from mtrain.inference import load_model
from mtrain.train import Trainer
from tests.support.cli import mtrain, run_cli
from tests.support.models import save_hf
from tests.support.training import RUN

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TARGETS = "q,k,v,o,gate,up,down"


@pytest.fixture(scope="module")
def lora_run(corpus, tmp_path_factory):  # noqa: F811
    """A Hugging Face Llama base, 3 LoRA steps on every Linear of its layers (rank 4, alpha 8), exported merged
    (llama_mistral) and as a PEFT adapter."""
    tmp = tmp_path_factory.mktemp("lora_export")
    base = save_hf("llama", tmp / "base", seed=4)
    mtrain("finetune", "--load", base, "--data.paths", corpus, "--train.steps", "3", "--checkpoint.dir", tmp / "run",
           "--lora.rank", "4", "--lora.alpha", "8", "--lora.targets", TARGETS, *RUN)
    run_cli("--loader", "mtrain", "--saver", "llama_mistral", "--load-dir", tmp / "run", "--save-dir", tmp / "merged")
    run_cli("--loader", "mtrain", "--saver", "peft", "--load-dir", tmp / "run", "--save-dir", tmp / "adapter")
    return tmp


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


TOKENS = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))


@pytest.mark.parity
def test_peft_loads_the_adapter_and_merges_to_our_export_bit_for_bit(lora_run):
    config = json.loads((lora_run / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["use_dora"]) == ("LORA", 4, 8.0, False)
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    adapted = peft.PeftModel.from_pretrained(hf_model(lora_run / "base"), lora_run / "adapter").eval()
    merged = hf_model(lora_run / "merged")
    with torch.no_grad():
        got, want, base = adapted(TOKENS).logits, merged(TOKENS).logits, hf_model(lora_run / "base")(TOKENS).logits
    # PEFT adds the adapters' output to the base's (x W^T + s (x A^T) B^T), the export multiplies by W + s B A: the
    # same function with sums in other orders; float32 logits below ~2 agree within a few ulps (measured 2e-7),
    # 1e-5 leaves a factor > 10. Training moved the logits by far more (checked below).
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (want - base).abs().max() > 1e-3
    # merge_and_unload computes W + (B @ A) * scale in the weights' float32, as our merge: equal to the bit
    ours = {n: p for n, p in merged.state_dict().items()}
    theirs = adapted.merge_and_unload().state_dict()
    assert set(theirs) == set(ours)
    assert all(torch.equal(theirs[n], ours[n]) for n in ours)


@pytest.mark.parity
def test_the_run_loads_directly_as_the_trained_model(lora_run, corpus):  # noqa: F811
    """load_model (generate, serve, evaluate) reads the run: its base with the adapters merged while loading; the
    trainer computes base + adapters unmerged. Same function, sums in other orders (bound as above)."""
    model, ir = load_model(lora_run / "run")
    assert ir.adapter is not None and ir.adapter.targets == TARGETS.split(",")
    trainer = Trainer(from_dict({  # resumes the run at step 3 (of 4), not run: its model holds the adapters
        "data": {"paths": [corpus], "seq_len": 32, "split": "90,10,0"},
        "train": {"steps": 4, "micro_batch_size": 2, "global_batch_size": 8},
        "checkpoint": {"dir": str(lora_run / "run"), "finetune": str(lora_run / "base")},
        "lora": {"rank": 4, "alpha": 8.0, "targets": TARGETS.split(",")}}), out=lambda _: None)
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), trainer.model(TOKENS), atol=1e-5, rtol=1e-5)
    trainer.close()
    out = mtrain("generate", "--load", lora_run / "run", "--prompt", "hello", "--greedy", "--max-new-tokens", "4")
    assert out.strip()
    evaluate = ["evaluate", "--data", corpus, "--seq-len", "32", "--max-samples", "4", "--load"]
    # the run and its merged export hold the same bytes: the same loss
    assert mtrain(*evaluate, lora_run / "run") == mtrain(*evaluate, lora_run / "merged")


def test_a_changed_base_is_refused_when_exporting(lora_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(lora_run / "run", run)
    meta_file = run / "step_0000003" / "mtrain.json"
    meta = json.loads(meta_file.read_text())
    meta["lora"]["base"] = str(save_hf("llama", tmp_path / "other", seed=5))
    meta_file.write_text(json.dumps(meta))
    out = run_cli("--loader", "mtrain", "--saver", "llama_mistral", "--load-dir", run, "--save-dir", tmp_path / "x",
                  expect_error=True)
    assert out.startswith(f"Error: {meta_file}: the LoRA run's base {tmp_path / 'other'} has changed since the "
                          "adapters were trained: ")
    assert "differs; restore that base" in out and not (tmp_path / "x").exists()


def test_peft_saver_refusals(lora_run, tmp_path):
    out = run_cli("--saver", "peft", "--load-dir", lora_run / "base", "--save-dir", tmp_path / "a", expect_error=True)
    assert out.startswith(f"Error: the peft saver writes LoRA adapters, and {lora_run / 'base'} ")
    assert "holds none: give a LoRA run of mtrain (lora.rank > 0)" in out
    with pytest.raises(ConvertError, match=r"^PEFT adapters: the gpt2 family is not supported \(its HF layout fuses"):
        peft_format.modules("gpt2")


@pytest.mark.parity
def test_expert_adapters_merge_into_each_expert(corpus, tmp_path):  # noqa: F811
    """Per-expert adapters (target experts) on a Mixtral: the merged export (each expert's W + s B_e A_e) run by
    transformers computes the trainer's adapted model (bound as above: float32 logits, other sum orders); PEFT has
    no Linear module for transformers' fused experts, so the peft saver refuses them by name."""
    base = save_hf("mixtral", tmp_path / "base", seed=3)
    args = ["--load", base, "--data.paths", corpus, "--checkpoint.dir", tmp_path / "run", "--lora.rank", "4",
            "--lora.targets", "q,experts", *RUN]
    mtrain("finetune", *args, "--train.steps", "2")
    run_cli("--saver", "mixtral_hf", "--load-dir", tmp_path / "run", "--save-dir", tmp_path / "merged")
    trainer = Trainer(from_dict({
        "data": {"paths": [corpus], "seq_len": 32, "split": "90,10,0"},
        "train": {"steps": 3, "micro_batch_size": 2, "global_batch_size": 8},
        "checkpoint": {"dir": str(tmp_path / "run"), "finetune": str(base)},
        "lora": {"rank": 4, "targets": ["q", "experts"]}}), out=lambda _: None)
    trainer.model.eval()
    with torch.no_grad():
        got, want = hf_model(tmp_path / "merged")(TOKENS).logits, trainer.model(TOKENS)
        before = hf_model(base)(TOKENS).logits
    trainer.close()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - before).abs().max() > 1e-4  # the adapters moved it
    out = run_cli("--loader", "mtrain", "--saver", "peft", "--load-dir", tmp_path / "run", "--save-dir",
                  tmp_path / "adapter", expect_error=True)
    assert out.startswith("Error: PEFT adapters: layers.0.moe.experts.0.gate.weight: adapters of MoE experts are not "
                          "written in PEFT's format")


def test_serve_answers_from_the_run_as_from_its_merged_export(lora_run):
    """`mtrain serve --load RUN` serves the LoRA run itself (its base with the adapters merged while loading, as
    generate and evaluate): greedy completions equal those served from the merged export, which holds the same
    bytes (see the evaluate check above), so the same computation picks the same tokens."""
    from tests.support.server import request, running_server

    body = {"model": "m", "prompt": [[5, 37, 42, 8], [9, 3]], "max_tokens": 6, "temperature": 0}
    answers = []
    for load in (lora_run / "run", lora_run / "merged"):
        with running_server(load, "--model-name", "m") as s:
            status, answer = request(s.url + "/v1/completions", body)
            assert status == 200, answer
            answers.append([(c["index"], c["text"]) for c in answer["choices"]])
    assert answers[0] == answers[1] and len(answers[0]) == 2 and all(text for _, text in answers[0])
