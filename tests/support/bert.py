"""The tiny BERT models the BERT tests build (nothing downloaded), and the MLM logits transformers computes.

    make_megatron_bert  transformers' MegatronBertForPreTraining (pooler, binary head) or ...ForMaskedLM, random
    make_bert           transformers' post-LN BertForPreTraining / BertForMaskedLM, random
    bert_inputs         tokens, token types and a padding mask with padded positions
    hf_bert_logits      transformers' MLM (and next-sentence) logits of a saved model
    float32_bound       how far two float32 evaluations of one function may differ
    megatron_core_bert_logits  megatron-core's own BertModel's logits on a core checkpoint
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.models import perturb_norms, write_tokenizer

VOCAB = 300
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=64, type_vocab_size=2)


def _save(cls_name: str, config_name: str, path: Path, seed: int, dtype: torch.dtype, **overrides) -> Path:
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**(SHAPE | overrides))
    model = getattr(transformers, cls_name)(config).to(dtype)
    perturb_norms(model, seed)  # LayerNorms and biases random too (the MLM bias starts at zero)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("predictions.bias"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed + 2))
    model.save_pretrained(path)
    write_tokenizer(path, config.vocab_size)
    return path


def make_megatron_bert(path: Path, *, binary_head: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32,
                       **overrides) -> Path:
    """MegatronBertForPreTraining (binary_head) or MegatronBertForMaskedLM: 4 layers, hidden 64, 4 heads."""
    cls = "MegatronBertForPreTraining" if binary_head else "MegatronBertForMaskedLM"
    return _save(cls, "MegatronBertConfig", path, seed, dtype, **overrides)


def make_bert(path: Path, *, binary_head: bool = True, seed: int = 0, **overrides) -> Path:
    """HF's post-LN BertForPreTraining (binary_head) or BertForMaskedLM, in the shape of make_megatron_bert."""
    return _save("BertForPreTraining" if binary_head else "BertForMaskedLM", "BertConfig", path, seed, torch.float32,
                 **overrides)


def bert_inputs(batch: int = 2, seq: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens and token types; the second sample's last 3 positions are padding (mask 0)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1:, -3:] = 0
    return {"tokens": torch.randint(0, VOCAB, (batch, seq), generator=g),
            "types": torch.randint(0, 2, (batch, seq), generator=g), "mask": mask}


def hf_bert_logits(path: Path, inputs: dict[str, torch.Tensor],
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(MLM logits [b, s, V], next-sentence logits [b, 2] or None) of the transformers model saved at `path`, run
    in `dtype` (float64: the exact answer, for bounding float32's error)."""
    import transformers

    arch = transformers.AutoConfig.from_pretrained(path).architectures[0]
    model = getattr(transformers, arch).from_pretrained(path).to(dtype).eval()
    with torch.no_grad():
        out = model(input_ids=inputs["tokens"], token_type_ids=inputs.get("types"), attention_mask=inputs["mask"])
    mlm = out.prediction_logits if hasattr(out, "prediction_logits") else out.logits
    return mlm, getattr(out, "seq_relationship_logits", None)


def float32_bound(ours: torch.Tensor, exact: torch.Tensor) -> float:
    """How far another float32 evaluation of the same function may lie from `ours` (a float32 evaluation whose
    float64 counterpart is `exact`): |other - ours| <= |other - exact| + |ours - exact|, each of the size of
    float32's own error e = max|ours - exact|; 8 e (tests/mtrain/parity.py's K, which leaves a factor 4 over the
    expected 2 e) plus 4 float32 ulps of the largest value, for an `ours` that happens to round almost exactly."""
    err = (ours.double() - exact).abs().max().item()
    return 8 * err + 4 * torch.finfo(torch.float32).eps * exact.abs().max().item()


def megatron_core_bert_logits(core: Path, inputs: dict[str, torch.Tensor], tmp: Path,
                              python: Path | None = None) -> tuple[str, dict]:
    """tests/support/scripts/mcore_bert_logits.py run by `python` (default: this environment's, megatron-core
    0.16.1) on the core checkpoint: (its stdout, {"mlm": [b, s, V], "binary": [b, 2] or None})."""
    import os
    import subprocess
    import sys

    from tests.support.paths import REPO, SCRIPTS

    torch.save(inputs, tmp / "bert_inputs.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)} | {"PYTHONPATH": str(REPO),
                                                                               "OMP_NUM_THREADS": "1"}
    result = subprocess.run([str(python or sys.executable), str(SCRIPTS / "mcore_bert_logits.py"), str(core),
                             str(tmp / "bert_inputs.pt"), str(tmp / "bert_logits.pt")],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout, torch.load(tmp / "bert_logits.pt", weights_only=True)
