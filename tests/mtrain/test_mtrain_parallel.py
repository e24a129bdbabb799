"""Every parallel layout trains like one process: same losses and gradients (fp32), step after step.

Two torchrun launches hold all the multi-process runs (start-up is the expensive part):

    4 ranks   DP2 x TP2, PP2 x TP2 (tied embeddings, saving checkpoints), PP2 x TP2 + SP, EP2 x TP2 (Mixtral),
              PP2 interleaved x CP2 (Mixtral), DP2 x TP2 in bf16
    2 ranks   TP2, TP2 + SP, PP2 1F1B, PP2 GPipe with uneven stages, PP2 interleaved (4 virtual stages),
              PP2 zero bubble, EP2, CP2 (Llama and Mixtral), GPT-2 under TP2 + SP, PP2 in bf16, and a resume
              under DP2 of the TP2 x PP2 checkpoint

Each run records its gradients at the first and last step and its final weights (tests/mtrain/recording.py);
the same config in one process is the reference, run in float32 and in float64: float32's own distance from
float64, tensor by tensor, sets each bound (tests/mtrain/parity.py explains the rule and its margins).
The TP2 x PP2 checkpoint also resumes in one process and converts with mconvert to Hugging Face and to
Megatron-core TP2 PP2 holding the trainer's weights exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml

from mconvert import engine
from mconvert.ir.config import ModelConfig
from mconvert.options import Options
from mtrain import checkpoint
from mtrain.config import from_dict
from mtrain.models import state_dict_adapter
from tests.mtrain.recording import RecordingTrainer, merge
from tests.support.cli import run_cli
from tests.support.launch import launch, losses, with_sections
from tests.support.models import TINY_LLAMA, TINY_MIXTRAL
from tests.support.training import STEPS, check_tensors, config_raw
from tests.support.training import losses_and_valid as _losses_and_valid

LLAMA = TINY_LLAMA
LLAMA4 = TINY_LLAMA | {"num_layers": 4}  # pipeline stages and virtual stages need layers
TIED4 = LLAMA4 | {"tie_embeddings": True}  # the last stage keeps a copy of the embedding for the head
MIXTRAL = TINY_MIXTRAL
MIXTRAL4 = MIXTRAL | {"num_layers": 4}
# GPT-2: LayerNorm, biases, learned positions (split over the sequence under SP), tied embeddings
GPT2 = dict(family="gpt2", num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4,
            num_query_groups=4, head_dim=8, vocab_size=64, max_position_embeddings=64, norm="layernorm",
            activation="gelu_tanh", position_embedding="learned", qkv_bias=True, proj_bias=True, mlp_bias=True,
            tie_embeddings=True)

# name: (model, parallel section, launch)
LAYOUTS = {
    "dp2_tp2": (LLAMA, {"tp": 2}, 4),
    "pp2_tp2_tied": (TIED4, {"tp": 2, "pp": 2}, 4),
    "pp2_tp2_sp": (LLAMA4, {"tp": 2, "pp": 2, "sequence_parallel": True}, 4),  # stages pass (B, T/2, h)
    "ep2_tp2": (MIXTRAL, {"ep": 2, "tp": 2}, 4),
    "pp2_vpp2_cp2_mixtral": (MIXTRAL4, {"pp": 2, "vpp": 2, "cp": 2}, 4),
    "tp2": (LLAMA, {"tp": 2}, 2),
    "tp2_sp": (LLAMA, {"tp": 2, "sequence_parallel": True}, 2),
    "pp2_1f1b": (LLAMA4, {"pp": 2}, 2),
    "pp2_gpipe_uneven": (LLAMA4, {"pp": 2, "pp_schedule": "GPipe", "first_stage_layers": 1}, 2),
    "pp2_interleaved": (LLAMA4, {"pp": 2, "vpp": 2}, 2),
    "pp2_zero_bubble": (LLAMA4, {"pp": 2, "vpp": 2, "pp_schedule": "InterleavedZeroBubble"}, 2),
    "ep2": (MIXTRAL, {"ep": 2}, 2),
    "cp2": (LLAMA, {"cp": 2}, 2),
    "cp2_mixtral": (MIXTRAL, {"cp": 2}, 2),
    "gpt2_tp2_sp": (GPT2, {"tp": 2, "sequence_parallel": True}, 2),
}
# bf16 compute (fp32 master weights): FSDP's mixed precision with TP, autocast through a pipeline schedule
BF16 = {"dp2_tp2_bf16": (LLAMA, {"tp": 2}, 4), "pp2_bf16": (LLAMA4, {"pp": 2}, 2)}
SAVER = "pp2_tp2_tied"  # saves at steps 2 and 4; step 2 is resumed under DP2 and in one process


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):  # noqa: F811
    """Both launches, then the one-process references: {name: ((losses, validation losses), record, reference)}."""
    tmp = tmp_path_factory.mktemp("parallel")
    specs: dict[int, list[dict]] = {4: [], 2: []}
    for name, (model, parallel, nproc) in LAYOUTS.items():
        ckpt = {"dir": str(tmp / "saved"), "interval": 2, "keep_last": 5} if name == SAVER else {}
        raw = with_sections(config_raw(corpus, model, checkpoint=ckpt), parallel=parallel)
        specs[nproc].append({"config": raw, "out": str(tmp / f"{name}.json"), "record": str(tmp / name),
                             "grads_at": [1, STEPS]})
    for name, (model, parallel, nproc) in BF16.items():
        raw = with_sections(config_raw(corpus, model, train={"steps": STEPS, "precision": "bf16"}), parallel=parallel)
        specs[nproc].append({"config": raw, "out": str(tmp / f"{name}.json")})
    launch(specs[4], tmp, nproc=4, name="four")
    # The TP2 x PP2 run's step-2 checkpoint, resumed under DP2 (2 ranks) and in one process.
    for copy in ("resume-dp2", "resume-dp1"):
        _checkpoint_at_step_2(tmp / "saved", tmp / copy)
    specs[2].append({"config": config_raw(corpus, TIED4, checkpoint={"dir": str(tmp / "resume-dp2")}),
                     "out": str(tmp / "resume-dp2.json")})
    # The command line takes the layout as overrides.
    (tmp / "run.yaml").write_text(yaml.safe_dump(config_raw(corpus, LLAMA)))
    specs[2].append({"cli": ["pretrain", "--config", str(tmp / "run.yaml"), "--parallel.tp", "2",
                             "--parallel.sequence_parallel", "true", "--train.steps", "2",
                             "--checkpoint.dir", str(tmp / "cli")]})
    launch(specs[2], tmp, nproc=2, name="two")

    references = {}
    out = {}
    for name, (model, _, _) in LAYOUTS.items():
        key = repr(model)
        if key not in references:
            references[key] = RecordingTrainer.reference(from_dict(config_raw(corpus, model)), grads_at=(1, STEPS))
        out[name] = (_losses_and_valid(tmp / f"{name}.json"), merge(sorted(tmp.glob(f"{name}.rank*.pt"))),
                     references[key])
    for name, (model, parallel, nproc) in BF16.items():
        out[name] = (_losses_and_valid(tmp / f"{name}.json"), references[repr(model)].result.losses)
    return tmp, out, corpus


def _checkpoint_at_step_2(saved: Path, dest: Path) -> None:
    shutil.copytree(saved, dest)
    shutil.rmtree(dest / "step_0000004")
    (dest / "latest").write_text("step_0000002\n")


@pytest.mark.parity
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_losses_match_one_process(runs, name):
    """Training losses at every step and validation losses (every 2 steps), within 8 times float32's own error
    from float64 plus 16 ulps (parity.Reference.loss_bound): ~2e-6 relative, where a wrong layout (a missing
    all-reduce, a shard read twice) changes the loss in its leading digits."""
    _, out, _ = runs
    (got, got_valid), _, reference = out[name]
    assert sorted(got) == list(range(1, STEPS + 1)) and sorted(got_valid) == [2, 4]
    reference.check_losses(got)
    reference.check_losses(got_valid, "valid")
    assert got[STEPS] < got[1]


@pytest.mark.parity
@pytest.mark.parametrize("name", list(BF16))
def test_bf16_trains_under_parallel_layouts(runs, name):
    """bf16 compute against the float32 run: bf16 rounds to 8 significant bits (2^-8 = 0.4% relative), so logits
    (below ~1 here: the loss starts at log 64 = 4.16) move by ~0.01 and the loss, by at most twice the largest
    logit change, by ~0.02 (measured: 0.01 at most); 0.05 admits that and catches a model that does not train
    (the loss falls by 0.26 over these 4 steps)."""
    _, out, _ = runs
    (got, _), fp32 = out[name]
    for step in fp32:
        assert abs(got[step] - fp32[step]) < 0.05, (step, got[step], fp32[step])
        assert got[step] != fp32[step]  # bf16 did apply
    assert got[STEPS] < got[1]


@pytest.mark.parity
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gradients_and_weights_match_one_process(runs, name):
    """Gradients at the first and last step and the final weights, every tensor within K = 8 times float32's own
    distance from float64 (parity.py). At the first step that is ~1e-5 of each tensor's size or less; later,
    Adam's m/sqrt(v) amplifies the last bits of near-zero gradient entries, in the float32 reference as in the
    layout, and the bounds follow (2.4e-3 of a tensor's size at most, GPT-2's); a gradient off by a factor of 2 or
    a partial sum misses them 100 times or more (check_tensors() checks that the bounds stay below 1e-2 of every
    tensor's size but the key biases')."""
    _, out, _ = runs
    _, got, reference = out[name]
    check_tensors(name, got, reference)


# What rank 0 holds (shape of its shard, placements): proof that each layout really splits the model.
RANK0 = {
    "tp2": {"layers.0.attn.q.weight": ([16, 32], "(Shard(dim=0),)"),  # 4 heads of 8 -> 2 heads
            "layers.0.attn.o.weight": ([32, 16], "(Shard(dim=1),)"),
            "layers.0.attn_norm.weight": ([32], "(Replicate(),)"), "embed.weight": ([32, 32], "(Shard(dim=0),)"),
            "lm_head.weight": ([32, 32], "(Shard(dim=0),)")},
    # FSDP shards TP's shard again: rows of the TP shard, strided over the whole tensor
    "dp2_tp2": {"layers.0.attn.q.weight": ([8, 32], "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),
                "layers.0.mlp.down.weight": ([16, 32], "(Shard(dim=0), Shard(dim=1))")},
    "ep2": {"layers.0.moe.experts.gate": ([2, 64, 32], "(Shard(dim=0),)"),  # experts 0, 1 of 4
            "layers.0.moe.router.weight": ([2, 32], "(Shard(dim=0),)")},  # FSDP over the 2 data ranks
    "ep2_tp2": {"layers.0.moe.experts.gate": ([2, 32, 32], "(Shard(dim=0), Shard(dim=1))"),
                "layers.0.moe.experts.down": ([2, 32, 32], "(Shard(dim=0), Shard(dim=2))")},
    "cp2": {"layers.0.attn.q.weight": ([16, 32], "(Shard(dim=0),)")},  # FSDP over the context-parallel ranks
}


@pytest.mark.parametrize("name", list(RANK0))
def test_each_rank_holds_its_shard(runs, name):
    _, out, _ = runs
    rank0 = out[name][1]["ranks"][0]
    for param, expected in RANK0[name].items():
        assert tuple(rank0[param]) == expected, (param, rank0[param])
    if LAYOUTS[name][1].get("tp", 1) > 1:  # every parameter a DTensor (norms too), as foreach optimizers need
        assert all(placement != "plain tensor" for _, placement in rank0.values())


@pytest.mark.parametrize("name, stages", [("pp2_1f1b", [[0, 1], [2, 3]]), ("pp2_gpipe_uneven", [[0], [1, 2, 3]]),
                                          ("pp2_interleaved", [[0, 2], [1, 3]])])
def test_pipeline_ranks_hold_their_layers(runs, name, stages):
    """Stage layers follow mconvert's layout (interleaved: rank 0 has stages 0 and 2 = layers 0 and 2)."""
    _, out, _ = runs
    for rank, layers in enumerate(stages):
        held = {int(n.split(".")[1]) for n in out[name][1]["ranks"][rank] if n.startswith("layers.")}
        assert sorted(held) == layers, (name, rank, held)
    assert "embed.weight" in out[name][1]["ranks"][0] and "lm_head.weight" in out[name][1]["ranks"][1]
    assert "embed.weight" not in out[name][1]["ranks"][1] and "final_norm.weight" not in out[name][1]["ranks"][0]


@pytest.mark.parity
def test_tp2_pp2_checkpoint_resumes_under_dp2_and_in_one_process(runs):
    """Steps 3 and 4 after the resume, against the saving TP2 x PP2 run's: the same weights at step 2, then other
    summation orders, so within the bound of the layout test (parity.Reference.loss_bound of this model, which
    covers float32's error from step 1 on)."""
    tmp, out, corpus = runs  # noqa: F811
    saver_losses, reference = out[SAVER][0][0], out[SAVER][2]
    meta = checkpoint.read_meta(tmp / "saved" / "step_0000002")
    assert meta["world_size"] == 4 and meta["parallel"]["tp"] == 2 and meta["parallel"]["pp"] == 2
    dp2 = losses(tmp / "resume-dp2.json")
    one = RecordingTrainer(from_dict(config_raw(corpus, TIED4, checkpoint={"dir": str(tmp / "resume-dp1")})))
    result, _ = one.run_and_record()
    assert result.resumed_from == tmp / "resume-dp1" / "step_0000002"
    assert sorted(dp2) == sorted(result.losses) == [3, 4]
    for step in (3, 4):
        bound = reference.loss_bound("losses", step)
        assert abs(dp2[step] - saver_losses[step]) <= bound, (step, dp2[step], saver_losses[step])
        assert abs(result.losses[step] - saver_losses[step]) <= bound, (step, result.losses[step], saver_losses[step])


@pytest.mark.parity
def test_tp2_pp2_checkpoint_converts_to_hf_and_core_with_the_trainers_weights(runs):
    tmp, out, _ = runs
    weights = out[SAVER][1]["weights"]  # what the trainer's model held at the end (step 4)
    want = state_dict_adapter.to_ir(ModelConfig(**TIED4), weights)
    run_cli("--saver", "llama_mistral", "--load-dir", tmp / "saved", "--save-dir", tmp / "hf")
    run_cli("--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", tmp / "saved", "--save-dir", tmp / "core")
    assert sorted(p.name for p in (tmp / "core" / "iter_0000004").glob("mp_rank_*")) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    for path, loader in ((tmp / "hf", "llama_mistral"), (tmp / "core", "core")):
        ir = engine.load(path, Options(), loader)
        assert sorted(n for n, _ in ir) == sorted(want), path
        for name, tensor in ir:
            assert torch.equal(tensor.load(), want[name]), (path, name)


def test_command_line_sets_the_layout(runs):
    tmp, _, _ = runs
    meta = checkpoint.read_meta(tmp / "cli" / "step_0000002")
    assert meta["parallel"]["tp"] == 2 and meta["parallel"]["sequence_parallel"] is True
    assert meta["parallel"]["dp"] == 1 and meta["world_size"] == 2
    ir = engine.load(tmp / "cli", Options())
    assert ir.source.layout == {"data_parallel": 1, "tp": 2}
