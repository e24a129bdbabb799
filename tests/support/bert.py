"""The tiny BERT models the BERT tests build (nothing downloaded), and the MLM logits transformers computes.

    make_megatron_bert  transformers' MegatronBertForPreTraining (pooler, binary head) or ...ForMaskedLM, random
    make_bert           transformers' post-LN BertForPreTraining / BertForMaskedLM, random
    bert_inputs         tokens, token types and a padding mask with padded positions
    hf_bert_logits      transformers' MLM (and next-sentence) logits of a saved model
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


def hf_bert_logits(path: Path, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(MLM logits [b, s, V], next-sentence logits [b, 2] or None) of the transformers model saved at `path`."""
    from transformers import AutoConfig
    import transformers

    arch = AutoConfig.from_pretrained(path).architectures[0]
    model = getattr(transformers, arch).from_pretrained(path).eval()
    with torch.no_grad():
        out = model(input_ids=inputs["tokens"], token_type_ids=inputs.get("types"), attention_mask=inputs["mask"])
    mlm = out.prediction_logits if hasattr(out, "prediction_logits") else out.logits
    return mlm, getattr(out, "seq_relationship_logits", None)
