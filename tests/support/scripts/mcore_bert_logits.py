"""Independent check: megatron-core builds its own BertModel from the args of a `core` BERT checkpoint we wrote,
loads the weights strictly and computes the MLM (and binary-head) logits, which a test compares with transformers'.

    python tests/support/scripts/mcore_bert_logits.py CORE_DIR INPUTS_PT OUT_PT
    python tests/support/scripts/mcore_bert_logits.py --keys [--te] [--binary-head]

CORE_DIR: a TP1 PP1 `torch`-format checkpoint with the local spec, or a `torch_dist` one (read by megatron-core's
own dist_checkpointing into the model's sharded state dict, after checking that it holds exactly the keys the
model asks for). INPUTS_PT: {"tokens": [b, s], "types": [b, s] or
absent, "mask": [b, s] of 1 (attend) / 0 (padding)}. OUT_PT gets {"mlm": [b, s, V] (vocabulary padding
stripped), "binary": [b, 2] or None}. The model is megatron-core's BertModel with its own local layer spec
(`bert_layer_local_spec`), token types when the checkpoint has a token-type embedding (num_tokentypes is not an
argument Megatron-LM stores: it is 2 with the binary head) and the binary head as args.bert_binary_head says.
`--keys` prints the state-dict keys of a tiny BertModel (local or TE spec) instead: what the key tables follow.
Runs in this environment (megatron-core 0.16.1) or in .venv-mcore-0.19 (0.19.2).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def use_repository_packages() -> None:
    """mconvert is not installed in a megatron-core environment: PYTHONPATH finds it (see mcore_logits.py)."""
    import mconvert

    root = str(Path(__file__).resolve().parents[3])
    if importlib.util.find_spec("mconvert.formats") is None and root not in mconvert.__path__:
        mconvert.__path__.append(root)


use_repository_packages()
from mconvert.io.torch_pickle import safe_load  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from mcore_logits import check_dist_keys  # noqa: E402
from mcore_moe import megatron_on_cpu  # noqa: E402


def transformer_config(args):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size, layernorm_epsilon=args.layernorm_epsilon,
        activation_func=F.gelu, add_bias_linear=args.add_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, perform_initialization=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        bias_activation_fusion=False)


def build(args, num_tokentypes: int, te: bool = False):
    from megatron.core.models.bert import bert_layer_specs
    from megatron.core.models.bert.bert_model import BertModel

    spec = bert_layer_specs.bert_layer_with_transformer_engine_spec if te else bert_layer_specs.bert_layer_local_spec
    return BertModel(config=transformer_config(args), num_tokentypes=num_tokentypes, transformer_layer_spec=spec,
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     add_binary_head=bool(args.bert_binary_head),
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


def load_state(model, it_dir: Path):
    if (it_dir / "metadata.json").is_file():
        from megatron.core import dist_checkpointing

        check_dist_keys(model.sharded_state_dict(), it_dir)  # exactly the keys the model asks for
        loaded = dist_checkpointing.load(model.sharded_state_dict(), str(it_dir))
        return {k: v for k, v in loaded.items() if k in model.state_dict()}, "torch_dist"
    return dict(safe_load(it_dir / "mp_rank_00" / "model_optim_rng.pt")["model"]), "torch"


def print_keys(te: bool, binary_head: bool) -> None:
    import argparse

    args = argparse.Namespace(num_layers=1, hidden_size=8, num_attention_heads=2, kv_channels=4, ffn_hidden_size=16,
                              layernorm_epsilon=1e-5, add_bias_linear=True, padded_vocab_size=16,
                              max_position_embeddings=8, bert_binary_head=binary_head,
                              untie_embeddings_and_output_weights=False)
    for k, v in build(args, 2 if binary_head else 0, te).state_dict().items():
        print(k, tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__)


def main(core_dir: str, inputs_file: str, out_file: str) -> None:
    it_dir = Path(core_dir) / "iter_0000001"
    common = it_dir / ("common.pt" if (it_dir / "metadata.json").is_file() else "mp_rank_00/model_optim_rng.pt")
    args = safe_load(common)["args"]
    inputs = torch.load(inputs_file, weights_only=True)
    types = inputs.get("types")
    model = build(args, num_tokentypes=int(getattr(args, "mconvert_num_tokentypes", 2 if args.bert_binary_head
                                                   else 0)))
    state, kind = load_state(model, it_dir)
    result = model.load_state_dict(state, strict=True)  # raises on any missing or extra key
    print(f"{kind}, strict load: {result}", flush=True)
    with torch.no_grad():
        mlm, binary = model.eval()(inputs["tokens"], inputs["mask"], tokentype_ids=types)
    torch.save({"mlm": mlm[..., :args.vocab_size], "binary": binary}, out_file)


if __name__ == "__main__":
    megatron_on_cpu()
    if sys.argv[1] == "--keys":
        print_keys("--te" in sys.argv, "--binary-head" in sys.argv)
    else:
        main(*sys.argv[1:])
