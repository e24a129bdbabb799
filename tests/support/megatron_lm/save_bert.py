"""Write BERT checkpoints with Megatron-LM 0.19's own `save_checkpoint`, and Megatron's logits for each.

    python tests/support/megatron_lm/save_bert.py OUT_DIR SPEC_JSON

SPEC_JSON is a list of {"name", "flags"}: Megatron command-line flags for one tiny BERT (save format, shape,
`--bert-no-binary-head`...). Each model is megatron-core's BertModel as Megatron-LM's pretrain_bert.py builds it
(the local layer spec, 2 token types with the binary head and none without, the output layer tied to the word
embeddings), with Megatron's own random initialization (norm weights and biases then randomized so that a mix-up
changes the numbers), saved to OUT_DIR/<name> at iteration 3 and run on fixed inputs: OUT_DIR/<name>.pt holds
{"tokens", "types", "mask", "mlm" (over the padded vocabulary), "binary" or None}. The second sample's last three
positions are padding. Runs in the megatron-core 0.19 environment (scripts/megatron_envs.sh).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import cpu  # noqa: E402
from save import randomize_norms  # noqa: E402


def build_bert(args):
    """pretrain_bert.py's model_provider (local spec), on one stage."""
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.training.arguments import core_transformer_config_from_args

    return BertModel(config=core_transformer_config_from_args(args),
                     num_tokentypes=2 if args.bert_binary_head else 0, transformer_layer_spec=bert_layer_local_spec,
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     pre_process=True, post_process=True, parallel_output=True,
                     add_binary_head=args.bert_binary_head,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


def save_one(root: Path, spec: dict) -> None:
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnBackend
    from megatron.training import checkpointing, global_vars

    args = cpu.megatron_args([*spec["flags"], "--save", str(root / spec["name"]), "--save-interval", "1",
                              "--train-iters", "3"])
    # BertModel asks for the local backend with megatron-core's own attention: what pretrain_bert runs with `--spec
    # local`, which Megatron-LM's argument check wants beside `--attention-backend local`; set after the check
    args.attention_backend = AttnBackend.local
    cpu.init_parallel(args)
    model = build_bert(args)
    randomize_norms(model, seed=len(spec["name"]))
    checkpointing.save_checkpoint(3, [model], None, None, 0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec["vocab"], (2, 16), generator=g)
    types = torch.randint(0, 2, (2, 16), generator=g) if args.bert_binary_head else None
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, -3:] = 0
    with torch.no_grad():
        mlm, binary = model.eval()(tokens, mask, tokentype_ids=types)
    torch.save({"tokens": tokens, "types": types, "mask": mask, "mlm": mlm.float(), "binary": binary},
               root / f"{spec['name']}.pt")
    parallel_state.destroy_model_parallel()
    global_vars.unset_global_variables()
    print(f"saved {spec['name']}", flush=True)


def main(out: str, spec_json: str) -> None:
    cpu.patch_cuda()
    cpu.start_process_group()
    root = Path(out)
    for spec in json.loads(spec_json):
        save_one(root, spec)


if __name__ == "__main__":  # the async checkpoint writer spawns processes that re-import this module
    main(*sys.argv[1:])
