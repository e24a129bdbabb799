"""LoRA under parallel layouts trains like one process: the same losses, adapter gradients and adapter weights.

One 2-rank launch runs TP2 (q, k, v, gate, up column-parallel: B split by rows; o, down row-parallel: A split by
columns), TP2 with sequence parallel, PP2, FSDP and DDP over DP2 and CP2, each on the same Hugging Face Llama with
adapters on every Linear of the layers, and EP2 on a Mixtral with adapters on its attention and per expert;
the one-process run in float64 and float32 (tests/mtrain/parity.py) sets the bounds.
"""

from __future__ import annotations

import pytest
import torch

from mtrain.config import from_dict
from tests.mtrain.parity import at
from tests.mtrain.recording import RecordingTrainer, merge
from tests.support.launch import launch, with_sections
from tests.support.models import save_hf
from tests.support.training import STEPS, config_raw
from tests.support.training import losses_and_valid as _losses_and_valid

LORA = {"rank": 4, "alpha": 8.0, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}
LAYOUTS = {"tp2": {"tp": 2}, "tp2_sp": {"tp": 2, "sequence_parallel": True}, "pp2": {"pp": 2},
           "fsdp2": {"dp_mode": "fsdp"}, "ddp2": {"dp_mode": "ddp"}, "cp2": {"cp": 2}}


# a Mixtral base under expert parallel: adapters on its attention and on every expert (split over the ranks as the
# experts are), the experts' all-to-all in between
MOE_LAYOUTS = {"ep2_mixtral": {"ep": 2}}


@pytest.fixture(scope="module")
def lora_runs(corpus, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("lora_parallel")
    raws = {"llama": config_raw(corpus, None, checkpoint={"finetune": str(save_hf("llama", tmp / "base", seed=3))},
                                lora=LORA),
            "mixtral": config_raw(corpus, None, checkpoint={"finetune": str(save_hf("mixtral", tmp / "moe", seed=3))},
                                  lora={"rank": 4, "alpha": 8.0, "targets": ["q", "o", "experts"]})}
    layouts = {name: ("llama", p) for name, p in LAYOUTS.items()} | {n: ("mixtral", p) for n, p in MOE_LAYOUTS.items()}
    specs = [{"config": with_sections(raws[base], parallel=parallel), "out": str(tmp / f"{name}.json"),
              "record": str(tmp / name), "grads_at": [1, STEPS]} for name, (base, parallel) in layouts.items()]
    # per-expert adapters under expert tensor parallel are not built: refused before anything is
    specs.append({"config": with_sections(raws["mixtral"], parallel={"tp": 2}), "error": str(tmp / "etp.json")})
    launch(specs, tmp, nproc=2, name="lora")
    (tmp / "etp.json").rename(tmp / "refused_etp.json")
    references = {base: RecordingTrainer.reference(from_dict(raw), grads_at=(1, STEPS)) for base, raw in raws.items()}
    return {name: (_losses_and_valid(tmp / f"{name}.json"), merge(sorted(tmp.glob(f"{name}.rank*.pt"))),
                   references[base]) for name, (base, _) in layouts.items()}


@pytest.mark.parity
@pytest.mark.parametrize("name", [*LAYOUTS, *MOE_LAYOUTS])
def test_lora_layouts_match_one_process(lora_runs, name):
    """Bounds from float32's own error (tests/mtrain/parity.py): a layout sums the same products in another order.
    At step 1 B is zero, so every A gradient is exactly zero in any layout (a zero bound: equal to the bit); the
    frozen base has no gradients and ends exactly where it started, in every layout."""
    (got_losses, got_valid), record, reference = lora_runs[name]
    reference.check_losses(got_losses)
    reference.check_losses(got_valid, "valid")
    for where in (("grads", 1), ("grads", STEPS), ("weights",)):
        assert not reference.noise_determined(where), where
        got, want = at(record, where), at(reference.record, where)
        assert set(got) == set(want), (name, where)
        for tensor, value in want.items():
            bound = reference.bound(where, tensor)
            diff = float((got[tensor].double() - value.double()).abs().max())
            assert diff <= bound, (name, where, tensor, diff, bound)
    grads = at(record, ("grads", 1))
    assert set(grads) == {n for n in at(record, ("weights",)) if ".lora_" in n}  # the base gets no gradients
    assert all(not t.any() for n, t in grads.items() if ".lora_A." in n)
    assert any(t.abs().max() > 0 for n, t in grads.items() if ".lora_B." in n)


@pytest.mark.parametrize("name", ["tp2"])
def test_lora_adapters_split_as_their_base_layers(lora_runs, name):
    """Column-parallel bases (q, up) split B by rows and keep A whole; row-parallel ones (o, down) split A by
    columns and keep B whole (hidden 64, ffn 96, q 64 rows, rank 4, tp 2)."""
    local = lora_runs[name][1]["ranks"][0]
    assert local["layers.0.attn.q.lora_A.weight"][0] == [4, 64]
    assert local["layers.0.attn.q.lora_B.weight"][0] == [32, 4]
    assert local["layers.0.mlp.up.lora_B.weight"][0] == [48, 4]
    assert local["layers.0.attn.o.lora_A.weight"][0] == [4, 32]
    assert local["layers.0.attn.o.lora_B.weight"][0] == [64, 4]
    assert local["layers.0.mlp.down.lora_A.weight"][0] == [4, 48]
    assert torch.Size(local["layers.0.mlp.down.lora_B.weight"][0]) == torch.Size([64, 4])


def test_expert_adapters_under_expert_tensor_parallel_are_refused(lora_runs, tmp_path_factory):
    import json

    path = next(tmp_path_factory.getbasetemp().glob("lora_parallel*/refused_etp.json"))
    assert json.loads(path.read_text())["error"] == (
        "lora.targets experts with parallel.tp > 1 (expert tensor parallel): not built yet; adapt the experts under "
        "expert and data parallel, or leave experts out of lora.targets")
