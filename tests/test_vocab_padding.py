"""Vocabulary padding of the Megatron savers: none by default (the divisor Megatron-Bridge would choose, for the
output's TP), the least where the vocabulary is not a multiple of TP, Megatron-LM's own with
--make-vocab-size-divisible-by; the divisor recorded so Megatron-LM's formula gives the stored table, and said."""

from __future__ import annotations

import pytest

from mconvert.io.torch_pickle import safe_load
from mconvert.rules.transforms import padded_vocab_size, vocab_divisor
from tests.support.cli import run_cli
from tests.support.compare import assert_same_tensors, ir_tensors
from tests.support.layouts import rank_file
from tests.support.models import make_hf_model


@pytest.mark.parametrize(("vocab", "tp", "divisor"), [
    (32000, 1, 128), (32000, 2, 128), (1000, 1, 8), (1000, 2, 4), (300, 2, 2), (300, 4, 1), (384, 3, 128),
    (50257, 1, 1), (301, 2, 1), (151936, 8, 16), (128256, 8, 32),
])
def test_the_divisor_pads_nothing_when_tp_allows(vocab, tp, divisor):
    """The largest power of two <= 128 with divisor x TP dividing the vocabulary (Megatron-Bridge's rule at TP 1);
    where the vocabulary is not a multiple of TP (301 at TP 2), 1: Megatron's formula then pads the least."""
    assert vocab_divisor(vocab, tp) == divisor
    assert padded_vocab_size(vocab, divisor, tp) == (vocab if vocab % tp == 0 else -(-vocab // tp) * tp)
    assert divisor == 128 or vocab % (2 * divisor * tp)  # the largest such power of two


def args_of(out, rel="mp_rank_00_000"):
    path = next(out.glob("iter_*/common.pt"), None) or rank_file(out, rel)
    return safe_load(path, mmap=False)["args"]


@pytest.mark.parametrize("saver", [("core", "--pp", "2"), ("core", "--ckpt-format", "torch_dist"),
                                   ("legacy", "--pp", "2")], ids=["core-torch", "core-torch_dist", "legacy"])
def test_every_megatron_saver_pads_nothing_by_default(saver, llama_dir, tmp_path):
    """300 rows at TP 2: divisor 2 (2 x 2 divides 300, 8 x 2 does not), recorded in args; Megatron-LM's formula
    (padded_vocab_size) with the recorded divisor gives the 300 rows stored; the note names the flag."""
    out = run_cli("--saver", *saver, "--tp", "2", "--load-dir", llama_dir, "--save-dir", tmp_path / "m")
    assert "note: vocabulary of 300 rows not padded; resume Megatron-LM at TP 2 with --make-vocab-size-divisible-by " \
           "2 (recorded in args; its default 128 builds 512 rows)" in out
    args = args_of(tmp_path / "m")
    assert (args.padded_vocab_size, args.make_vocab_size_divisible_by) == (300, 2)
    assert padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size) \
        == 300
    assert_same_tensors(ir_tensors(llama_dir), ir_tensors(tmp_path / "m"))


def test_padding_a_vocabulary_that_is_not_a_multiple_of_tp(tmp_path):
    """301 rows cannot be split over 2 ranks: padded by one row (divisor 1), said, and stripped when read back."""
    src = make_hf_model(tmp_path / "hf", "llama", vocab_size=301, seed=4)
    out = run_cli("--saver", "core", "--tp", "2", "--load-dir", src, "--save-dir", tmp_path / "m")
    assert "note: vocabulary of 301 rows padded to 302 rows (301 is not a multiple of TP 2; the padded rows raise " \
           "the loss Megatron reports); resume Megatron-LM at TP 2 with --make-vocab-size-divisible-by 1" in out
    args = args_of(tmp_path / "m", "mp_rank_00")
    assert (args.padded_vocab_size, args.make_vocab_size_divisible_by) == (302, 1)
    assert_same_tensors(ir_tensors(src), ir_tensors(tmp_path / "m"))


def test_an_asked_divisor_pads_as_megatron_lm(llama_dir, tmp_path):
    """--make-vocab-size-divisible-by 128 at TP 2: Megatron-LM's classic table (300 -> 512 rows), no note."""
    out = run_cli("--saver", "core", "--tp", "2", "--make-vocab-size-divisible-by", "128", "--load-dir", llama_dir,
                  "--save-dir", tmp_path / "m")
    assert "vocabulary of" not in out
    args = args_of(tmp_path / "m", "mp_rank_00")
    assert (args.padded_vocab_size, args.make_vocab_size_divisible_by) == (512, 128)



@pytest.mark.parametrize(("saver", "tp", "rel", "padded"), [
    (("core",), 1, "mp_rank_00", 384), (("core", "--ckpt-format", "torch_dist"), 4, None, 512),
    (("legacy",), 2, "mp_rank_00", 512),
], ids=["core-tp1", "torch_dist-tp4", "legacy-tp2"])
def test_a_megatron_source_keeps_its_divisor(saver, tp, rel, padded, llama_dir, tmp_path):
    """A Megatron-LM checkpoint resharded keeps the divisor its run pads with, so its resume with unchanged flags
    builds the stored table: 300 rows padded to 512 at TP 2 (Megatron-LM's 128) become 384 rows at TP 1 and stay
    512 at TP 4 and in legacy TP 2, each with divisor 128 recorded and said; the real rows unchanged."""
    run_cli("--saver", "core", "--tp", "2", "--make-vocab-size-divisible-by", "128", "--load-dir", llama_dir,
            "--save-dir", tmp_path / "src")
    out = run_cli("--loader", "core", "--saver", *saver, "--tp", str(tp), "--load-dir", tmp_path / "src",
                  "--save-dir", tmp_path / "m")
    assert f"note: vocabulary of 300 rows padded to {padded} rows with the source's divisor 128; resume " \
           f"Megatron-LM at TP {tp} with --make-vocab-size-divisible-by 128 (recorded in args)" in out
    args = args_of(tmp_path / "m", rel) if rel else args_of(tmp_path / "m")
    assert (args.padded_vocab_size, args.make_vocab_size_divisible_by) == (padded, 128)
    assert_same_tensors(ir_tensors(llama_dir), ir_tensors(tmp_path / "m"))


def test_an_unpadded_source_stays_unpadded(llama_dir, tmp_path):
    """mconvert's own default output (300 rows, divisor 2 at TP 2) resharded to TP 4: still no padded row (300 is
    a multiple of 4 but not of 2 x 4, so divisor 1)."""
    run_cli("--saver", "core", "--tp", "2", "--load-dir", llama_dir, "--save-dir", tmp_path / "src")
    run_cli("--loader", "core", "--saver", "core", "--tp", "4", "--load-dir", tmp_path / "src", "--save-dir",
            tmp_path / "m")
    args = args_of(tmp_path / "m", "mp_rank_00")
    assert (args.padded_vocab_size, args.make_vocab_size_divisible_by) == (300, 1)
