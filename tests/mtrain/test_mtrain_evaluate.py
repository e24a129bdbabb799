"""`mtrain evaluate`: splits, sample and token limits, the sequence length taken from the checkpoint and refused
beyond the model's positions, progress lines, and the zero-shot last-word accuracy task."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from mtrain.cli import main
from mtrain.data.gpt_dataset import split_ranges
from mtrain.data.indexed import IndexedDataset
from mtrain.data.tokenizer import load_tokenizer
from mtrain.generation import generate
from mtrain.inference import eval_windows, load_model
from mtrain.tasks import last_word_accuracy, read_passages
from mtrain.train import Trainer
from tests.support.corpus import write_tokenizer
from tests.support.models import make_hf, save_hf
from tests.support.training import tiny_config


def mtrain(*args, ok=True):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert (result.exit_code == 0) == ok, result.output
    return result


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny HF Llama (vocabulary 300 > the corpus's 64, 256 positions) with the corpus's word-level tokenizer
    (w3 … w299; its <bos>/<eos> cannot be mistaken for the start of a word)."""
    path = save_hf("llama", tmp_path_factory.mktemp("eval") / "hf", seed=6)
    write_tokenizer(path, 300)
    return path


def windows_of(prefix: str, split: str, weights: str, seq_len: int) -> int:
    """Windows one epoch of a split holds: (its tokens - 1) // seq_len."""
    ds = IndexedDataset(prefix)
    begin, end = split_ranges(len(ds), weights)[("train", "valid", "test").index(split)]
    return (int(ds.sequence_lengths[begin:end].sum()) - 1) // seq_len


def test_splits_limits_and_progress(hf, corpus):  # noqa: F811
    args = ["evaluate", "--load", hf, "--data", corpus, "--seq-len", "32", "--batch-size", "4"]
    for split in ("train", "valid", "test"):
        r = mtrain(*args, "--split", split, "--split-weights", "80,15,5")
        n = windows_of(corpus, split, "80,15,5", 32)
        assert f"| {n} samples of 32 tokens ({n * 32:,} predicted tokens, split {split})" in r.stdout
        assert f"windows: {n}/{n} (100%)" in r.stderr  # progress, on stderr
    everything = mtrain(*args).stdout
    assert everything == mtrain(*args, "--split", "valid", "--split-weights", "0,1,0").stdout.replace(
        "split valid", "split all")
    assert "| 5 samples of 32 tokens (160 predicted" in mtrain(*args, "--max-samples", "5").stdout
    assert "| 3 samples of 32 tokens (96 predicted" in mtrain(*args, "--max-tokens", "70").stdout
    out = mtrain(*args, "--split", "test", "--split-weights", "100,0,0", ok=False).output
    assert "the test split of" in out and "is empty: split weights 100,0,0 over 300 documents" in out


@pytest.mark.parity
def test_loss_equals_transformers(hf, corpus):  # noqa: F811
    out = mtrain("evaluate", "--load", hf, "--data", corpus, "--seq-len", "32", "--max-samples", "6").stdout
    windows = eval_windows([corpus], seq_len=32)[0]
    batch = torch.from_numpy(np.stack([windows[i] for i in range(6)]))
    with torch.no_grad():
        logits = make_hf("llama", seed=6)(batch[:, :-1]).logits
    want = float(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))
    # printed to 4 decimals (half a unit: 5e-5), from float32 logits agreeing with transformers' to ~1e-6: comparing
    # the printed digits alone would fail whenever the loss sits that close to a rounding boundary
    assert out.startswith("loss ") and abs(float(out.split()[1]) - want) <= 5e-5 + 1e-5, (out, want)


def test_sequence_length_from_the_checkpoint_and_refused_beyond_its_positions(hf, corpus, tmp_path):  # noqa: F811
    Trainer(tiny_config(corpus, train={"steps": 1}, checkpoint={"dir": str(tmp_path / "run")}),
            out=lambda _: None).run()
    r = mtrain("evaluate", "--load", tmp_path / "run", "--data", corpus, "--max-samples", "2")
    assert "sequence length 32 (from the run; --seq-len to change)" in r.stderr  # the run's data.seq_len
    assert "| 2 samples of 32 tokens" in r.stdout
    r = mtrain("evaluate", "--load", hf, "--data", corpus, "--max-samples", "1")
    # data.seq_len's default (1024), cut to the model's 256 positions: not a 32k window for a long-context model
    assert "sequence length 256 (data.seq_len's default, at most the model's positions; --seq-len to change)" \
        in r.stderr
    out = mtrain("evaluate", "--load", hf, "--data", corpus, "--split", "valid", ok=False).output
    assert "--split valid: " in out and "does not record the split of the run that trained it; give " \
        "--split-weights" in out  # rather than guess a valid split other than the run's
    for load, positions in ((hf, 256), (tmp_path / "run", 64)):  # rotary positions are refused too
        out = mtrain("evaluate", "--load", load, "--data", corpus, "--seq-len", str(positions + 1), ok=False).output
        assert (f"Error: --seq-len {positions + 1} is longer than the model's {positions} positions "
                f"(max_position_embeddings); use at most {positions}") in out


def test_last_word_accuracy(hf, tmp_path):
    """Passages whose last word is the model's greedy next word count as correct, the others do not."""
    model, _ = load_model(hf)
    tok = load_tokenizer(hf)
    rng = np.random.default_rng(0)
    lines, expected = [], 0
    for i in range(12):
        context = [int(t) for t in rng.integers(30, 299, size=int(rng.integers(3, 9)))]  # words w30 … w298
        greedy = generate(model, context, max_new_tokens=1, greedy=True)[0]
        last = greedy if i % 3 else (greedy + 1 - 30) % 269 + 30  # every third passage: a wrong last word
        expected += last == greedy
        lines.append(json.dumps({"text": tok.decode(context + [last])}))
    (tmp_path / "lambada.jsonl").write_text("\n".join(lines) + "\n")
    out = mtrain("evaluate", "--load", hf, "--lambada", tmp_path / "lambada.jsonl", "--batch-size", "5").stdout
    assert expected == 8
    assert out.strip() == f"last-word accuracy {8 / 12:.4f} (8/12 passages of {tmp_path / 'lambada.jsonl'})"
    passages = read_passages(tmp_path / "lambada.jsonl", tok, max_samples=4)
    assert len(passages) == 4 and last_word_accuracy(model, passages).total == 4


def test_last_word_accuracy_with_words_of_several_tokens(tmp_path):
    """A byte-pair tokenizer splits words into pieces: the whole word must be predicted, checked against a
    per-passage reference on transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = save_hf("llama", tmp_path / "hf", seed=7)
    words = ["".join(chr(97 + c) for c in np.random.default_rng(i).integers(0, 6, size=7)) for i in range(40)]
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.train_from_iterator([" ".join(words)] * 10, trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    bpe.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").unlink()
    rng = np.random.default_rng(1)
    texts = [" ".join(words[j] for j in rng.integers(0, 40, size=int(rng.integers(3, 7)))) for _ in range(10)]
    (tmp_path / "task.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = load_tokenizer(hf)
    passages = read_passages(tmp_path / "task.jsonl", tok)
    assert max(len(p.target) for p in passages) > 1
    reference = make_hf("llama", seed=7)
    correct = 0
    for text in texts:
        cut = text.rfind(" ")
        context, target = tok.encode(text[:cut]), tok.encode(text[cut:], special=False)
        with torch.no_grad():
            logits = reference(torch.tensor([context + target[:-1]])).logits[0]
        correct += logits[len(context) - 1:].argmax(-1).tolist() == target
    model, _ = load_model(hf)
    result = last_word_accuracy(model, passages, batch_size=3)
    assert (result.correct, result.total) == (correct, 10)


def test_task_file_errors(hf, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "t5 t6"}\n{"txt": "t5"}\n')
    out = mtrain("evaluate", "--load", hf, "--lambada", tmp_path / "bad.jsonl", ok=False).output
    assert f"Error: {tmp_path / 'bad.jsonl'}:2: expected a JSON object with a 'text' text field" in out
    (tmp_path / "one.jsonl").write_text('{"text": "t5"}\n')
    out = mtrain("evaluate", "--load", hf, "--lambada", tmp_path / "one.jsonl", ok=False).output
    assert "one.jsonl:1: the passage needs a context and a last word, found 't5'" in out
    assert "give --data PREFIX" in mtrain("evaluate", "--load", hf, ok=False).output
