"""BERT in mtrain: Megatron's masking and sentence pairs (mtrain/data/bert_dataset.py), the bidirectional encoder
with its MLM and NSP heads (mtrain/models/bert.py), training that learns, validation's MLM/NSP figures, resuming,
and tensor (+sequence) and data parallel runs like one process (the bounds of tests/mtrain/parity.py).

The corpus (tests/support/bert_corpus.py) is written sentence by sentence, as BERT's data is: a noisy Markov chain, so
a masked word is predictable from its neighbours.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from mconvert import engine
from mconvert.ir.config import ModelConfig
from mconvert.options import Options
from mtrain import weights
from mtrain.cli import main as mtrain_main
from mtrain.config import from_dict
from mtrain.data.bert_dataset import IGNORE, BertDataset, MaskingConfig, SpecialTokens, split_batch
from mtrain.data.gpt_dataset import split_ranges
from mtrain.data.indexed import IndexedDataset, IndexedDatasetWriter
from mtrain.data.loader import RankBatches, build_splits, masking_config
from mtrain.errors import TrainError
from mtrain.inference import load_model
from mtrain.models.bert import BertModel, bert_loss
from mtrain.train import Trainer
from tests.mtrain.recording import RecordingTrainer, merge
from tests.support.bert import float32_bound
from tests.support.bert_corpus import CLS, MASK, PAD, SEP, SPECIAL, TINY_BERT, VOCAB, build_bert_corpus
from tests.support.cli import run_cli
from tests.support.launch import launch, with_sections
from tests.support.training import STEPS, check_tensors, losses_and_valid

SEQ = 32
MASKING = MaskingConfig(seq_len=SEQ, vocab_size=VOCAB, special=SpecialTokens(cls=CLS, sep=SEP, mask=MASK, pad=PAD))


@pytest.fixture(scope="module")
def bert_corpus(tmp_path_factory) -> str:
    return build_bert_corpus(tmp_path_factory.mktemp("bert_corpus"))


def raw_config(prefix: str, **sections) -> dict:
    raw = {"model": dict(TINY_BERT), "data": {"paths": [prefix], "seq_len": SEQ, "split": "90,10,0"},
           "train": {"steps": STEPS, "micro_batch_size": 2, "global_batch_size": 8},
           "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2}, "eval": {"interval": 2, "steps": 1},
           "logging": {"interval": 1000}, "mlm": SPECIAL}
    return with_sections(raw, **sections)


def numbered_sentences(tmp_path) -> IndexedDataset:
    """Documents of 2-6 sentences whose tokens are all 4 + the sentence's number in its document (so a sample's
    original tokens say which sentences it holds and in which order)."""
    rng = np.random.RandomState(0)
    writer = IndexedDatasetWriter(tmp_path / "numbered", np.uint16)
    for _ in range(300):
        writer.add_document(sentences=[[4 + j] * rng.randint(2, 9) for j in range(rng.randint(2, 7))])
    writer.finalize()
    return IndexedDataset(tmp_path / "numbered")


def originals(sample: np.ndarray) -> np.ndarray:
    """The tokens before masking: the labels where a token was predicted."""
    return np.where(sample[3] != IGNORE, sample[3], sample[0])


def test_masking_follows_megatron(tmp_path):
    """Per sample exactly min(floor(n), candidates) tokens are predicted, n = min(0.15 x target, max(1, round(0.15 x
    length))) (Megatron's count), never [CLS], [SEP] or padding; of the predicted ones 80% become [MASK], 10% a
    random id, 10% stay.
    Over N predictions each share lies within 4.5 binomial standard deviations sqrt(p (1 - p) / N) of its p (a
    fixed seed: the same draw every run; 4.5 sigma leaves a true rule a 1e-5 chance of failing on a new seed). A
    random id equals the original with probability 1/V, so "kept" is 0.1 + 0.1/V and "random" 0.1 - 0.1/V."""
    ds = BertDataset(numbered_sentences(tmp_path), np.arange(300), MASKING, 2000)
    masked = kept = random = 0
    for i in range(2000):
        sample, (_, _, target) = ds[i], ds.sample_index[i]
        tokens, types, padding, labels = sample[:4]
        length = int(np.flatnonzero(originals(sample) == SEP)[-1]) + 1  # [SEP] ends a sample and is never masked
        assert (tokens[length:] == PAD).all() and np.array_equal(padding, tokens != PAD)  # a random [PAD] too
        original = originals(sample)[:length]
        assert original[0] == CLS and original[-1] == SEP and length <= target + 3
        candidates = int(((original != CLS) & (original != SEP)).sum())
        n = min(0.15 * target, max(1, round(0.15 * length)))
        predicted = labels != IGNORE
        assert int(predicted.sum()) == min(math.floor(n), candidates), i
        assert not predicted[~np.isin(np.arange(SEQ), np.flatnonzero((original != CLS) & (original != SEP)))].any()
        masked += int((tokens[predicted] == MASK).sum())
        kept += int((tokens[predicted] == labels[predicted]).sum())
        random += int(((tokens[predicted] != MASK) & (tokens[predicted] != labels[predicted])).sum())
    total = masked + kept + random
    for count, p in ((masked, 0.8), (kept, 0.1 + 0.1 / VOCAB), (random, 0.1 - 0.1 / VOCAB)):
        assert abs(count / total - p) <= 4.5 * math.sqrt(p * (1 - p) / total), (count, total, p)


def test_sentence_pairs_are_next_or_swapped(tmp_path):
    """With NSP: [CLS] A [SEP] B [SEP], types 0 up to the first [SEP] and 1 after; A's sentences come before B's in
    the document unless is_random, when they are swapped (about half the samples: within 4.5 binomial
    standard deviations). Without NSP: [CLS] A [SEP] of one or more sentences, types 0."""
    indexed = numbered_sentences(tmp_path)
    ds = BertDataset(indexed, np.arange(300), MASKING, 1000)
    swapped = 0
    for i in range(1000):
        sample = ds[i]
        original, types = originals(sample), sample[1]
        length = int(np.flatnonzero(original == SEP)[-1]) + 1
        seps = np.flatnonzero(original[:length] == SEP)
        assert len(seps) == 2 and seps[1] == length - 1
        assert (types[:seps[0] + 1] == 0).all() and (types[seps[0] + 1:length] == 1).all()
        a, b = set(original[1:seps[0]]), set(original[seps[0] + 1:length - 1])
        assert a and b and not a & b
        is_random = sample[4, 0]
        assert (sample[4] == is_random).all()
        first, second = (b, a) if is_random else (a, b)
        assert max(first) < min(second)  # truncation may drop a whole short sentence at either end of A or B
        swapped += int(is_random)
    assert abs(swapped / 1000 - 0.5) <= 4.5 * math.sqrt(0.25 / 1000)
    single = BertDataset(indexed, np.arange(300), MaskingConfig(**{**MASKING.__dict__, "nsp": False}), 100)
    for i in range(100):
        sample = single[i]
        assert (sample[1] == 0).all() and (sample[4] == 0).all()
        assert int((originals(sample) == SEP).sum()) == 1


def test_sample_index_takes_whole_documents_in_order(tmp_path):
    """Every sample's sentences are consecutive ones of one document, at least two with NSP; the target lengths are
    seq_len - 3, or with probability 0.1 a shorter one; samples are a seeded shuffle (the same for the same seed),
    cached beside the data; a cached index that does not fit the data is rebuilt."""
    indexed = numbered_sentences(tmp_path)
    ds = BertDataset(indexed, np.arange(300), MASKING, 500)
    bounds = indexed.document_indices
    for first, end, target in ds.sample_index:
        doc = int(np.searchsorted(bounds, first, side="right") - 1)
        assert end <= bounds[doc + 1] and end - first >= 2 and 2 <= target <= SEQ - 3
    short = float((ds.sample_index[:, 2] < SEQ - 3).mean())
    assert 0 < short < 0.25
    again = BertDataset(indexed, np.arange(300), MASKING, 500)
    assert not ds.cache_hit and again.cache_hit
    assert (again.sample_index == ds.sample_index).all() and (again[7] == ds[7]).all()
    [cached] = (tmp_path / "cache" / "BertDataset_indices").glob("*-sample.npy")
    np.save(cached, np.array([[0, 10**6, 5]]))  # points past the data's sentences
    rebuilt = BertDataset(indexed, np.arange(300), MASKING, 500)
    assert not rebuilt.cache_hit and (rebuilt.sample_index == ds.sample_index).all()
    with pytest.raises(TrainError, match="next-sentence prediction needs documents of two or more sentences"):
        writer = IndexedDatasetWriter(tmp_path / "one", np.uint16)
        writer.add_document([5, 6, 7])
        writer.finalize()
        BertDataset(IndexedDataset(tmp_path / "one"), np.arange(1), MASKING, 4)


def tiny_model(**fields) -> BertModel:
    c = ModelConfig(**(TINY_BERT | fields))
    model = BertModel(c)
    weights.load_full_weights(model, weights.random_init(c, 1, 0.02))
    return model.eval()


def test_attention_is_bidirectional_and_padding_is_unseen():
    """A token changes the outputs at positions before it (no causal mask); a padding position's token and type
    change nothing at the real positions (its key is masked), exactly."""
    model = tiny_model()
    rng = np.random.RandomState(0)
    tokens = np.concatenate([[CLS], rng.randint(4, VOCAB, 10), [SEP], [PAD] * 4])
    inputs = torch.tensor(np.stack([tokens, np.zeros(16, int), (tokens != PAD).astype(int)]))[None]
    with torch.no_grad():
        logits, nsp = model(inputs)
        later = inputs.clone()
        later[0, 0, 9] = 5 if int(later[0, 0, 9]) != 5 else 6
        assert not torch.equal(model(later)[0][0, :9], logits[0, :9])
        padded = inputs.clone()
        padded[0, 0, 12:] = 40
        padded[0, 1, 12:] = 1
        other, other_nsp = model(padded)
    assert torch.equal(other[0, :12], logits[0, :12]) and torch.equal(other_nsp, nsp)


def test_bert_learns_and_validates(bert_corpus, tmp_path):
    """Masked-LM training on the Markov corpus lowers the validation MLM loss from about ln(V) (a uniform guess)
    by more than 0.3 nats between steps 50 and 300 (measured: 0.55 and 0.65 at learning rates 4e-3 and 2e-3; the
    rule predicts 80% of the words, so the optimum is below 2 and the loss is still falling there); validation
    reports MLM loss, NSP loss and accuracy; a resumed run continues with the same losses as an uninterrupted one
    (the same samples, weights and optimizer state: the same arithmetic in one process, equal bit for bit)."""
    raw = raw_config(bert_corpus, train={"steps": 300, "micro_batch_size": 8, "global_batch_size": 16},
                     optim={"lr": 4e-3, "min_lr": 4e-3, "warmup_steps": 10, "weight_decay": 0.0, "beta2": 0.999},
                     eval={"interval": 50, "steps": 4}, model={"binary_head": False})
    lines: list[str] = []
    result = Trainer(from_dict(raw), out=lines.append).run()
    assert abs(result.valid_losses[50] - math.log(VOCAB)) < 0.5
    assert result.valid_losses[300] < result.valid_losses[50] - 0.3, result.valid_losses
    assert any(line.startswith("validation at step 300: mlm loss") for line in lines)
    assert any(line.startswith("validation at step 300: loss ") for line in lines)
    assert not any("perplexity" in line for line in lines)  # exp(MLM + NSP loss) means nothing

    nsp = raw_config(bert_corpus, train={"steps": 4}, checkpoint={"dir": str(tmp_path / "run"), "interval": 2})
    whole = Trainer(from_dict(with_sections(nsp, checkpoint={"dir": str(tmp_path / "whole")}))).run()
    trainer = Trainer(from_dict(with_sections(nsp, train={"exit_after_steps": 2})))
    trainer.run()
    assert set(trainer.bert_eval) == {"mlm loss", "nsp loss", "nsp accuracy"}
    assert 0 <= trainer.bert_eval["nsp accuracy"] <= 1
    resumed = Trainer(from_dict(nsp)).run()
    assert resumed.resumed_from is not None and resumed.losses == {s: whole.losses[s] for s in (3, 4)}


def test_bert_refusals(bert_corpus):
    """What BERT cannot train under, or without, is refused by name before any step."""
    with pytest.raises(TrainError, match="mlm.mask_id"):
        Trainer(from_dict(raw_config(bert_corpus, mlm={"mask_id": None}))).run()
    with pytest.raises(TrainError, match="mlm.cls_id 99 is outside"):
        Trainer(from_dict(raw_config(bert_corpus, mlm={"cls_id": 99}))).run()


def test_split_batch_packs_inputs_and_labels():
    rows = np.arange(2 * 5 * 4).reshape(2, 5, 4)
    inputs, labels = split_batch(rows)
    assert inputs.shape == (2, 3, 4) and labels.shape == (2, 5)
    assert torch.equal(labels[:, :4], torch.from_numpy(rows[:, 3])) and torch.equal(labels[:, 4],
                                                                                   torch.from_numpy(rows[:, 4, 0]))


# HF's post-LN BERT with its own (untied) LM head: the other head and norm placement
POST_LN = {"family": "bert", "post_norm": True, "tie_embeddings": False}
# name: (model fields over TINY_BERT, parallel section)
LAYOUTS = {"bert_tp2": ({}, {"tp": 2}), "bert_tp2_sp": ({}, {"tp": 2, "sequence_parallel": True}),
           "bert_dp2": ({}, {}), "bert_fsdp2": ({}, {"dp_mode": "fsdp"}), "bert_pp2": ({}, {"pp": 2}),
           "bert_post_ln_pp2": (POST_LN, {"pp": 2}),
           "bert_post_ln_tp2_sp": (POST_LN, {"tp": 2, "sequence_parallel": True})}


@pytest.fixture(scope="module")
def runs(bert_corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bert_parallel")
    raws = {name: raw_config(bert_corpus, model=model) for name, (model, _) in LAYOUTS.items()}
    specs = [{"config": with_sections(raws[name], parallel=parallel), "out": str(tmp / f"{name}.json"),
              "record": str(tmp / name), "grads_at": [1, STEPS]} for name, (_, parallel) in LAYOUTS.items()]
    specs.append({"config": raw_config(bert_corpus, parallel={"cp": 2}), "error": str(tmp / "cp2.json")})
    launch(specs, tmp, nproc=2, name="bert")
    references = {}
    for name, (model, _) in LAYOUTS.items():
        if repr(model) not in references:
            references[repr(model)] = RecordingTrainer.reference(from_dict(raws[name]), grads_at=(1, STEPS))
    out = {name: (losses_and_valid(tmp / f"{name}.json"), merge(sorted(tmp.glob(f"{name}.rank*.pt"))),
                  references[repr(model)]) for name, (model, _) in LAYOUTS.items()}
    return out | {"cp2 error": json.loads((tmp / "cp2.json").read_text())["error"]}


@pytest.mark.parity
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(runs, name):
    """MLM + NSP losses (training and validation), gradients at the first and last step and final weights of each
    layout within parity.Reference's bounds: the layout is one process's function with its sums in another order
    (vocab-sharded logits and the loss over them, partial products all-reduced, DDP's and FSDP's averaged
    gradients, the pipeline's micro-batches with the padding mask handed to every stage), so it
    must be as close to the float64 run as float32's own reordered runs are (K = 8 times their error, parity.py)."""
    (got, got_valid), record, reference = runs[name]
    reference.check_losses(got)
    reference.check_losses(got_valid, "valid")
    check_tensors(name, record, reference)


def test_context_parallel_is_refused_by_name(runs):
    assert "BERT (megatron_bert) trains under data, tensor (+sequence) and pipeline parallelism; parallel.cp 2 " \
           "must be 1" in runs["cp2 error"]


_HF_NAMES = [  # transformers' (MegatronBert | Bert)ForPreTraining -> IR names (HF's post-LN norms in parentheses)
    (r"bert\.embeddings\.word_embeddings", "embed"), (r"bert\.embeddings\.position_embeddings", "pos_embed"),
    (r"bert\.embeddings\.token_type_embeddings", "token_type_embed"), (r"bert\.embeddings\.LayerNorm", "embed_norm"),
    (r"bert\.encoder\.layer\.(\d+)\.attention\.(ln|output\.LayerNorm)", r"layers.\1.attn_norm"),
    (r"bert\.encoder\.layer\.(\d+)\.attention\.self\.query", r"layers.\1.attn.q"),
    (r"bert\.encoder\.layer\.(\d+)\.attention\.self\.key", r"layers.\1.attn.k"),
    (r"bert\.encoder\.layer\.(\d+)\.attention\.self\.value", r"layers.\1.attn.v"),
    (r"bert\.encoder\.layer\.(\d+)\.attention\.output\.dense", r"layers.\1.attn.o"),
    (r"bert\.encoder\.layer\.(\d+)\.(ln|output\.LayerNorm)", r"layers.\1.mlp_norm"),
    (r"bert\.encoder\.layer\.(\d+)\.intermediate\.dense", r"layers.\1.mlp.up"),
    (r"bert\.encoder\.layer\.(\d+)\.output\.dense", r"layers.\1.mlp.down"),
    (r"bert\.encoder\.ln", "final_norm"), (r"bert\.pooler\.dense", "pooler"),
    (r"cls\.predictions\.transform\.dense", "mlm_head.dense"),
    (r"cls\.predictions\.transform\.LayerNorm", "mlm_head.norm"),
    (r"cls\.predictions\.bias", "lm_head.bias"), (r"cls\.seq_relationship", "nsp_head"),
]


def _ir_name(hf: str) -> str | None:
    for pattern, ir in _HF_NAMES:
        m = re.fullmatch(pattern + r"(\.weight|\.bias)?", hf)
        if m:
            return m.expand(ir) + (m.groups()[-1] or "")
    return None  # the tied decoder (cls.predictions.decoder.*): the embedding and lm_head.bias


@pytest.mark.parity
@pytest.mark.parametrize("family", ["megatron_bert", "bert", "bert_gelu_tanh"])
def test_forward_is_transformers_bert(family):
    """Our MLM and NSP logits are transformers' MegatronBertForPreTraining's (Megatron's pre-LN BERT) and
    BertForPreTraining's (post-LN; also with the tanh GELU in the MLP and the MLM head), on the same weights,
    tokens, token types and padding mask. Both run in float64 with the same operations in a different order:
    float64's rounding (2^-52 per operation, a few hundred operations deep) stays below 1e-12 of the logits' size;
    1e-10 leaves a factor of 100 and still catches any wrong operation (a missing bias or norm moves the logits by
    about their own size)."""
    import transformers

    hf_config = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=1e-12)
    if family == "bert":
        hf = transformers.BertForPreTraining(transformers.BertConfig(**hf_config))
        ours = tiny_model(family="bert", post_norm=True)
    elif family == "bert_gelu_tanh":
        hf = transformers.BertForPreTraining(transformers.BertConfig(**hf_config, hidden_act="gelu_pytorch_tanh"))
        ours = tiny_model(family="bert", post_norm=True, activation="gelu_tanh", mlm_head_activation="gelu_tanh")
    else:
        hf = transformers.MegatronBertForPreTraining(transformers.MegatronBertConfig(**hf_config))
        ours = tiny_model()
    hf = hf.double().eval()
    ours = ours.double()
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, tensor in hf.state_dict().items():
            if (ir := _ir_name(name)) is not None:
                params.pop(ir).copy_(tensor)
    assert not params, sorted(params)  # every parameter of ours came from transformers
    rng = np.random.RandomState(0)
    tokens = torch.tensor(rng.randint(4, VOCAB, (3, 20)))
    types = torch.tensor(rng.randint(0, 2, (3, 20)))
    padding = torch.ones(3, 20, dtype=torch.long)
    padding[1, 14:] = 0
    with torch.no_grad():
        want = hf(input_ids=tokens, token_type_ids=types, attention_mask=padding)
        logits, nsp = ours(torch.stack([tokens, types, padding], dim=1))
    for got, expected in ((logits, want.prediction_logits), (nsp, want.seq_relationship_logits)):
        assert float((got - expected).abs().max()) <= 1e-10 * float(expected.abs().max())


def test_finetune_from_a_checkpoint_and_read_it_back(bert_corpus, tmp_path):
    """A finetune starts from any checkpoint mconvert reads as a BERT IR (here an mtrain run, through the `mtrain`
    loader, with a finetune config that has no model section): at learning rate 0 (AdamW's decoupled weight decay
    is lr x wd x w: 0 too) its weights stay the source's exactly, and mconvert reads its checkpoint back as the same
    IR, every BERT tensor under its IR name, ready for any saver."""
    pre = raw_config(bert_corpus, train={"steps": 2}, checkpoint={"dir": str(tmp_path / "pre")})
    Trainer(from_dict(pre)).run()
    finetune = raw_config(bert_corpus, train={"steps": 2}, optim={"lr": 0.0, "min_lr": 0.0},
                          checkpoint={"dir": str(tmp_path / "ft"), "finetune": str(tmp_path / "pre")})
    del finetune["model"]
    lines: list[str] = []
    Trainer(from_dict(finetune), out=lines.append).run()
    assert any(line.startswith(f"finetuning from {tmp_path / 'pre'}") for line in lines)
    source, tuned = engine.load(tmp_path / "pre", Options()), engine.load(tmp_path / "ft", Options())
    assert tuned.config == source.config and tuned.config.is_bert and tuned.config.binary_head
    names = [name for name, _ in source]
    assert names == [name for name, _ in tuned] and "lm_head.bias" in names and "nsp_head.weight" in names
    for name in names:
        assert torch.equal(source[name].load(), tuned[name].load()), name


def test_evaluate_reports_mlm_and_nsp(bert_corpus, tmp_path):
    """`mtrain evaluate --data` of a BERT checkpoint prints the MLM loss (mean cross entropy per predicted token),
    NSP loss and accuracy (per sample) on one epoch of masked samples of the split, masked with the run's special
    ids and sequence length: the figures computed here from the same samples, to the 4 printed decimals.
    `mtrain generate` refuses an encoder by name."""
    Trainer(from_dict(raw_config(bert_corpus, train={"steps": 2}, checkpoint={"dir": str(tmp_path / "run")}))).run()
    result = CliRunner().invoke(mtrain_main, ["evaluate", "--load", str(tmp_path / "run"), "--data", bert_corpus,
                                              "--split", "valid"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    model, _ = load_model(tmp_path / "run")
    indexed = IndexedDataset(bert_corpus)
    documents = len(indexed.document_indices) - 1
    begin, end = split_ranges(documents, "90,10,0")[1]
    ds = BertDataset(indexed, np.arange(begin, end), MaskingConfig(**{**MASKING.__dict__, "seed": 1234}), 1)
    inputs, labels = split_batch(np.stack([ds[i] for i in range(len(ds))]))
    with torch.no_grad():
        logits, nsp = model(inputs)
    mlm = F.cross_entropy(logits.flatten(0, 1).double(), labels[:, :-1].flatten(), ignore_index=IGNORE)
    nsp_loss = F.cross_entropy(nsp.double(), labels[:, -1])
    accuracy = float((nsp.argmax(-1) == labels[:, -1]).double().mean())
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"mlm loss {float(mlm):.4f} | nsp loss {float(nsp_loss):.4f} | nsp accuracy "
                           f"{accuracy:.4f} | {len(ds)} samples of at most {SEQ} tokens"), line
    refused = CliRunner().invoke(mtrain_main, ["generate", "--load", str(tmp_path / "run"), "--tokens", "5 6"])
    assert refused.exit_code != 0 and "Error: " in refused.output and "is a BERT encoder (megatron_bert): generate " \
        "needs a model that predicts the next token" in refused.output, refused.output


@pytest.mark.parity
@pytest.mark.parametrize("source", ["hf", "core"])
def test_finetune_from_transformers_megatron_bert_and_export(bert_corpus, tmp_path, source):
    """`mtrain finetune` of a transformers MegatronBertForPreTraining directory (the `megatron_bert_hf` loader), or
    of its conversion to a Megatron-core checkpoint (`mconvert --saver core`, read back by the `core` loader):
    its first step's loss is transformers' MLM + NSP loss on the same masked batch (both float32; the bound is
    tests/support/bert.py's float32_bound: 8 x float32's own error, measured against transformers in float64, plus
    4 ulps), and at learning rate 0 the `megatron_bert_hf` saver exports the finetune's checkpoint as the very
    tensors it started from."""
    import transformers

    from tests.support.bert import make_megatron_bert

    hf = make_megatron_bert(tmp_path / "hf")
    start = hf
    if source == "core":
        start = tmp_path / "core"
        run_cli("--saver", "core", "--load-dir", hf, "--save-dir", start)
    raw = raw_config(bert_corpus, train={"steps": 1}, optim={"lr": 0.0, "min_lr": 0.0},
                     checkpoint={"dir": str(tmp_path / "ft"), "finetune": str(start)})
    del raw["model"]
    config = from_dict(raw)
    got = Trainer(config).run().losses[1]
    masking = masking_config(config.data, config.mlm, 300, None, True)
    splits = build_splits(config.data, {"train": 8}, masking)
    batches = RankBatches(splits["train"], global_batch=8, micro_batch=2, rank=0, world=1, vocab_size=300,
                          collate=split_batch).next()

    def loss(dtype: torch.dtype) -> torch.Tensor:
        model = transformers.MegatronBertForPreTraining.from_pretrained(hf).to(dtype).eval()
        total = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for inputs, labels in batches:
                out = model(input_ids=inputs[:, 0], token_type_ids=inputs[:, 1], attention_mask=inputs[:, 2])
                total += bert_loss((out.prediction_logits, out.seq_relationship_logits), labels).double()
        return total / len(batches)

    want = loss(torch.float32)
    assert abs(got - float(want)) <= float32_bound(want, loss(torch.float64)), (got, float(want))
    run_cli("--saver", "megatron_bert_hf", "--load-dir", tmp_path / "ft", "--save-dir", tmp_path / "out")
    source = transformers.MegatronBertForPreTraining.from_pretrained(hf).state_dict()
    exported = transformers.MegatronBertForPreTraining.from_pretrained(tmp_path / "out").state_dict()
    assert sorted(source) == sorted(exported)
    for name, tensor in source.items():
        assert torch.equal(tensor, exported[name]), name


def _bert_tokenizer(path) -> None:
    """A WordLevel tokenizer with BERT's special tokens that wraps what it encodes in [CLS] … [SEP]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, ".": 5, "!": 6, "?": 7}
    vocab |= {f"w{i}": 8 + i for i in range(56)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                                  ("[SEP]", 3)])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))


def test_preprocess_split_sentences_then_train_nsp(tmp_path):
    """`mtrain preprocess --split-sentences` writes a document's sentences as its sequences, without the
    tokenizer's [CLS]/[SEP] (BERT's samples add them); a BERT with the binary head trains on that data with the
    special ids taken from data.tokenizer, and a finetune of its checkpoint from the tokenizer the checkpoint
    carries."""
    _bert_tokenizer(tmp_path / "tok")
    rng = np.random.RandomState(0)
    with open(tmp_path / "corpus.jsonl", "w") as f:
        for _ in range(40):
            sentences = [" ".join(f"w{i}" for i in rng.randint(0, 56, rng.randint(2, 8))) + rng.choice([".", "!", "?"])
                         for _ in range(rng.randint(2, 5))]
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")
    result = CliRunner().invoke(mtrain_main, ["preprocess", "--input", str(tmp_path / "corpus.jsonl"),
                                              "--output-prefix", str(tmp_path / "bert"), "--tokenizer",
                                              str(tmp_path / "tok"), "--split-sentences"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    indexed = IndexedDataset(tmp_path / "bert_text_document")
    first = json.loads((tmp_path / "corpus.jsonl").read_text().splitlines()[0])["text"]
    sentences = [indexed.get(s).tolist() for s in range(indexed.document_indices[0], indexed.document_indices[1])]
    assert len(sentences) == first.count(".") + first.count("!") + first.count("?")
    assert all(s[-1] in (5, 6, 7) and 2 not in s and 3 not in s for s in sentences)
    raw = raw_config(str(tmp_path / "bert_text_document"), train={"steps": 2},
                     data={"tokenizer": str(tmp_path / "tok")}, eval={"interval": 2, "steps": 1},
                     checkpoint={"dir": str(tmp_path / "run")})
    raw["mlm"] = {}  # the special ids: the tokenizer's
    trainer = Trainer(from_dict(raw))
    result = trainer.run()
    assert sorted(result.losses) == [1, 2] and set(trainer.bert_eval) == {"mlm loss", "nsp loss", "nsp accuracy"}
    # a finetune of that checkpoint without data.tokenizer: the special ids from the tokenizer it carries
    finetune = with_sections(raw, checkpoint={"dir": str(tmp_path / "ft"), "finetune": str(tmp_path / "run")},
                             data={"tokenizer": None})
    del finetune["model"]
    assert sorted(Trainer(from_dict(finetune)).run().losses) == [1, 2]


@pytest.mark.parametrize("nsp", [True, False])
def test_samples_are_megatron_cores(tmp_path, nsp):
    """megatron-core's own BERT dataset code (0.16.1, installed here: its C++ build_mapping and
    BERTMaskedWordPieceDataset.__getitem__, whole-word masking off, unigrams, no permutation) builds from the same
    documents, seed and settings the same sample index and the same samples, bit for bit: tokens, token types,
    padding mask, labels (Megatron's -1 is our IGNORE) and the NSP label."""
    from types import SimpleNamespace

    from megatron.core.datasets import helpers
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed

    prefix = build_bert_corpus(tmp_path)
    documents, samples, seed = np.arange(10, 110), 300, 1234
    cfg = MaskingConfig(**{**MASKING.__dict__, "nsp": nsp, "seed": seed})
    ours = BertDataset(IndexedDataset(prefix), documents, cfg, samples)
    theirs = MegatronIndexed(prefix)
    bounds = theirs.document_indices[np.append(documents, documents[-1] + 1)]
    index = helpers.build_mapping(bounds, theirs.sequence_lengths, np.iinfo(np.int32).max - 1, samples, SEQ - 3,
                                  cfg.short_seq_prob, seed, False, 2 if nsp else 1)
    assert np.array_equal(ours.sample_index, index.astype(np.int64))
    megatron = object.__new__(BERTMaskedWordPieceDataset)  # its __getitem__ on our index, without its file cache
    tokenizer = SimpleNamespace(cls=CLS, sep=SEP, mask=MASK, pad=PAD, inv_vocab={i: f"w{i}" for i in range(VOCAB)})
    megatron.config = SimpleNamespace(
        random_seed=seed, classification_head=nsp, sequence_length=SEQ, tokenizer=tokenizer,
        masking_probability=0.15, masking_max_ngram=1, masking_do_full_word=False, masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False, masking_do_permutation=False)
    megatron.dataset, megatron.sample_index, megatron._pad_token_id = theirs, index, PAD
    megatron.token_lookup = sorted(tokenizer.inv_vocab)
    for i in range(len(index)):
        want, got = megatron[i], ours[i]
        assert np.array_equal(got[0], want["text"]) and np.array_equal(got[1], want["types"]), i
        assert np.array_equal(got[2], want["padding_mask"]) and (got[4] == want["is_random"]).all(), i
        assert np.array_equal(np.where(got[3] == IGNORE, -1, got[3]), want["labels"]), i
