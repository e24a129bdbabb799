"""The `mtrain` command: preprocess, finetune from Hugging Face / Megatron checkpoints and export back through
mconvert, evaluate and generate, each checked against transformers."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from mtrain import checkpoint
from mtrain.config import from_dict
from mtrain.data.indexed import IndexedDataset
from mtrain.generation import filter_probs, generate
from mtrain.inference import load_model
from mtrain.train import Trainer
from tests.support.cli import mtrain, run_cli
from tests.support.corpus import write_corpus, write_tokenizer
from tests.support.models import TINY_LLAMA, make_hf, save_hf
from tests.support.paths import FIXTURES, REPO
from tests.support.training import RUN, first_batch_loss_by_transformers, tiny_config


def test_preprocess_command(tmp_path):
    write_tokenizer(tmp_path / "tok")
    write_corpus(tmp_path / "c.jsonl", documents=30)
    out = mtrain("preprocess", "--input", tmp_path / "c.jsonl", "--output-prefix", tmp_path / "data" / "c",
                 "--tokenizer", tmp_path / "tok", "--json-key", "text", "--append-eod", "--workers", "2")
    assert out.startswith("text: 30 documents, ")
    assert out.rstrip().endswith(f"-> {tmp_path}/data/c_text_document.bin/.idx")
    assert len(IndexedDataset(tmp_path / "data" / "c_text_document")) == 30
    assert "input file" in mtrain("preprocess", "--input", tmp_path / "nope.jsonl", "--output-prefix", tmp_path / "x",
                                  "--tokenizer", tmp_path / "tok", expect_error=True)


@pytest.mark.parity
def test_finetune_hf_then_export_to_hf(corpus, tmp_path):  # noqa: F811
    hf = save_hf("llama", tmp_path / "hf", seed=4)
    mtrain("finetune", "--load", hf, "--data.paths", corpus, "--train.steps", "3", "--checkpoint.dir",
           tmp_path / "ckpt", "--logging.tensorboard_dir", tmp_path / "tb", *RUN)
    meta = checkpoint.read_meta(tmp_path / "ckpt" / "step_0000003")
    assert meta["step"] == 3 and meta["model_config"]["vocab_size"] == 300

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(losses) == [1, 2, 3]  # the iteration count starts again at 1
    config = from_dict({"data": {"paths": [corpus], "seq_len": 32, "split": "90,10,0"},
                        "train": {"steps": 3, "micro_batch_size": 2, "global_batch_size": 8}})
    reference = make_hf("llama", seed=4)
    # transformers against mtrain in float32, the same sums in other orders: the logits (below 1) agree to ~1e-6,
    # a cross entropy moves by at most twice that (~4e-7 relative on 5.7), TensorBoard's float32 adds 6e-8; 1e-5
    # leaves a factor > 10
    assert losses[1] == pytest.approx(first_batch_loss_by_transformers(reference, config), rel=1e-5)

    run_cli("--saver", "llama_mistral", "--load-dir", tmp_path / "ckpt", "--save-dir", tmp_path / "exported")
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    trained, ir = load_model(tmp_path / "ckpt")
    assert ir.source.format == "mtrain"
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, before = trained(tokens), exported(tokens).logits, reference(tokens).logits
    # mtrain against transformers in float32: logits below ~1, each implementation within ~4e-7 of float64's
    # (measured for transformers), so 1e-5 (+ 1e-5 relative) leaves a factor > 10; training moved them by > 1e-3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - before).abs().max() > 1e-3  # it did train


@pytest.mark.skipif(not (FIXTURES / "llama_gqa").is_dir(), reason="needs ../shared/fixtures")
def test_evaluate_and_finetune_a_megatron_checkpoint(corpus, tmp_path):  # noqa: F811
    """A checkpoint written by Megatron (core, TP2 PP2) evaluates like its HF source and finetunes."""
    core, hf = FIXTURES / "llama_gqa" / "core_tp2pp2", FIXTURES / "llama_gqa" / "hf"
    args = ["--data", corpus, "--seq-len", "32", "--max-samples", "16"]
    # the last line is the result (progress lines come before it, on stderr)
    from_core, from_hf = (mtrain("evaluate", "--load", path, *args).splitlines()[-1] for path in (core, hf))
    assert from_core == from_hf and from_core.startswith("loss ")
    loss = float(from_core.split()[1])
    # both printed rounded: the loss to 4 decimals (exp of it off by up to 5e-5 relative), the perplexity to 3
    assert float(from_core.split("perplexity ")[1].split()[0]) == pytest.approx(math.exp(loss), rel=1e-3)
    mtrain("finetune", "--load", core, "--data.paths", corpus, "--train.steps", "2", "--checkpoint.dir",
           tmp_path / "ckpt", *RUN)
    assert checkpoint.read_meta(tmp_path / "ckpt" / "step_0000002")["step"] == 2


def test_finetune_with_a_model_that_does_not_fit(corpus, tmp_path):  # noqa: F811
    hf = save_hf("llama", tmp_path / "hf")
    out = mtrain("finetune", "--load", hf, "--data.paths", corpus, "--train.steps", "1", *RUN,
                 *[f"--model.{k}={v}" for k, v in (TINY_LLAMA | {"vocab_size": 300}).items()], expect_error=True)
    # a model section on finetune changes the checkpoint's config: shape fields are refused by name
    assert ("Error: model.hidden_size (64 in the checkpoint, 32 given), model.ffn_hidden_size (96 in the checkpoint, "
            "64 given), model.num_attention_heads (8 in the checkpoint, 4 given), model.num_query_groups (4 in the "
            f"checkpoint, 2 given): cannot change in a finetune of {tmp_path}/hf") in out
    assert "a finetune may change moe_aux_loss_coeff, moe_jitter_eps, max_position_embeddings" in out


def test_generate_greedy_matches_transformers(tmp_path):
    hf = save_hf("llama", tmp_path / "hf", seed=2)
    reference = make_hf("llama", seed=2)
    prompt = [5, 17, 42, 8]
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  attention_mask=torch.ones(1, 4, dtype=torch.long), pad_token_id=0)[0, 4:].tolist()
    model, _ = load_model(hf)
    assert generate(model, prompt, max_new_tokens=12, greedy=True) == want
    assert generate(model, prompt, max_new_tokens=12, top_k=1, seed=3) == want  # top-1 sampling is greedy
    sampled = [generate(model, prompt, max_new_tokens=12, top_p=0.9, seed=s) for s in range(3)]
    assert len({tuple(s) for s in sampled}) > 1
    out = mtrain("generate", "--load", hf, "--tokens", "5 17 42 8", "--max-new-tokens", "12", "--greedy")
    assert out.splitlines()[0].split() == [str(t) for t in prompt + want]  # then the text
    text = mtrain("generate", "--load", hf, "--prompt", "t5 t9 t3", "--max-new-tokens", "3", "--top-k", "5")
    assert text.startswith("t5 t9 t3 t") and 4 <= len(text.split()) <= 6  # uses the checkpoint's tokenizer


@pytest.mark.parity
def test_filter_probs():
    """A log, an exp and a renormalization in float32: a few ulps, within assert_close's float32 default (1.3e-6
    relative, 10 ulps)."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(filter_probs(logits, 2, None), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(filter_probs(logits, None, 0.7), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(filter_probs(logits, None, 0.4), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(filter_probs(logits, None, None), torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_killed_run_resumes_with_the_same_losses(corpus, tmp_path):  # noqa: F811
    """`python -m mtrain pretrain` killed with SIGKILL: the next run resumes from the last checkpoint and its
    losses equal those of a run that was never interrupted."""
    args = ["--data.paths", corpus, *RUN, "--optim.min_lr", "3e-4", "--train.steps", "100000",
            "--checkpoint.interval", "3"]
    model = [f"--model.{k}={v}" for k, v in TINY_LLAMA.items()]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "mtrain", "pretrain", *model, *args, "--checkpoint.dir",
                             str(tmp_path / "run")], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while checkpoint.find_latest(tmp_path / "run") is None:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.time() < deadline, "no checkpoint within 120 s"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    latest = checkpoint.find_latest(tmp_path / "run")
    done = checkpoint.read_meta(latest)["step"]
    cfg = dict(train={"steps": 100000, "exit_after_steps": 3}, optim={"lr": 1e-3, "warmup_steps": 1})
    resumed = Trainer(tiny_config(corpus, **cfg, checkpoint={"dir": str(tmp_path / "run"), "save_at_end": False}),
                      out=lambda _: None).run()
    assert resumed.resumed_from == latest and list(resumed.losses) == [done + 1, done + 2, done + 3]
    cfg["train"]["exit_after_steps"] = done + 3
    uninterrupted = Trainer(tiny_config(corpus, **cfg), out=lambda _: None).run()
    assert all(resumed.losses[s] == uninterrupted.losses[s] for s in resumed.losses)
    assert np.isfinite(list(resumed.losses.values())).all()
