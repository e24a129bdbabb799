"""`--training-state` from the distributed optimizer's bucket-space sharding types: `dp_reshardable` (Megatron-LM's
default) and `dp_zero_gather_scatter` (mconvert.megatron.bucket_optim).

megatron-core 0.19.2 itself (tests/support/megatron_lm/train.py: its DDP, distributed optimizer, save_checkpoint
and load_checkpoint, gloo on CPU) trains a tiny bf16 GPT 3 steps under TP2 x DP2 and saves dp_reshardable (each DP
rank's piece of a parameter a chunk of its own, some parameters cut between the two), and under TP2 saves
dp_zero_gather_scatter; Megatron re-saves the first as fully_reshardable itself (its own conversion). Every value
we read must be the one Megatron's re-save holds (bit for bit: both are the same fp32 numbers moved), and the
conversions must resume as Megatron resumes its own checkpoints: the same losses, exactly (bound 0: the stored
fp32 moments and master weights and the bf16 weights are moved without arithmetic, and the same inputs through
the same CPU kernels give the same bits).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mconvert import engine, workers
from mconvert.errors import ConvertError
from mconvert.io import dcp_writer
from mconvert.io.dcp import DcpReader
from mconvert.ir.config import ModelConfig
from mconvert.megatron import bucket_optim
from mconvert.options import Options
from mconvert.progress import Progress
from tests.support.cli import run_cli, train_megatron_runs
from tests.support.refusals import convert_refused

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--ckpt-format", "torch_dist", "--bf16", "--lr", "1e-3", "--global-batch-size", "4",
         "--micro-batch-size", "2", "--seed", "7", "--use-distributed-optimizer"]  # vocabulary 256: no padding
TP2 = [*FLAGS, "--tensor-model-parallel-size", "2"]
ITER = "iter_0000003"
STATE = Options(training_state=True)


# multi-latent attention with a query LoRA (megatron-core's local MLA with a plain core attention:
# tests/support/megatron_lm/cpu.py), alone and with one multi-token-prediction module (untied: Megatron's output
# layer comes after the MTP block). (Without a query LoRA 0.19's local spec refuses the query norm the IR's MLA has.)
MLA = [*FLAGS, "--multi-latent-attention", "--q-lora-rank", "48", "--kv-lora-rank", "32", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm", "--position-embedding-type", "rope",
       "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
       "--ffn-hidden-size", "128"]
MTP = [*MLA, "--mtp-num-layers", "1"]
FULLY = ["--dist-ckpt-optim-fully-reshardable"]


@pytest.fixture(scope="module")
def megatron(tmp_path_factory, mcore_python):
    """Megatron's checkpoints after 3 steps: dp_reshardable (TP2 x DP2, 4 processes), dp_zero_gather_scatter
    (TP2), and its own fully_reshardable re-save of the first (loaded under TP2 x DP1: Megatron reshards
    dp_reshardable across DP itself); and its resumption of the first under TP2 x DP1 for 3 steps. MLA models (one
    with an MTP module) trained under DP2, each saved as dp_reshardable and as fully_reshardable (the same
    training); our conversion of the MTP one resumed for 3 steps beside Megatron's own resumption of it, and our
    conversion of the first to TP2 resumed under TP2 x DP1; then, on one process, our conversion of the first to TP1
    and Megatron's re-save resumed under TP1, and a run saved in 4 buckets. Two launches."""
    python = mcore_python("0.19")
    tmp = tmp_path_factory.mktemp("training_state_buckets")
    r = {"python": python, "tmp": tmp, "dpr": tmp / "dpr", "dz": tmp / "dz", "resave": tmp / "resave"}
    out = lambda name: str(tmp / f"{name}.json")  # noqa: E731
    runs = [{"flags": TP2, "steps": 3, "out": out("dpr"), "save": str(r["dpr"]), "world": 4},
            {"flags": TP2, "steps": 3, "out": out("dz"), "save": str(r["dz"]),
             "optimizer_sharding": "dp_zero_gather_scatter"}]
    for name, flags in (("mla_dpr", MLA), ("mla_fully", [*MLA, *FULLY]), ("mtp_dpr", MTP),
                        ("mtp_fully", [*MTP, *FULLY])):
        r[name] = tmp / name
        runs.append({"flags": flags, "steps": 3, "out": out(name), "save": str(r[name])})
    train_megatron_runs(python, runs, 2)  # 4 processes, then the 2-process runs on the first two
    convert(r["mtp_dpr"], tmp / "mtp_ours")
    r["ours_tp2_output"] = convert(r["dpr"], tmp / "ours_tp2", "--tp", "2")
    r["ours_tp1_output"] = convert(r["dpr"], tmp / "ours_tp1")
    tp1 = [*FLAGS, "--no-load-rng"]
    train_megatron_runs(python, [
        {"flags": [*TP2, *FULLY], "steps": 0, "out": out("resave"), "load": str(r["dpr"]), "save": str(r["resave"])},
        {"flags": TP2, "steps": 3, "out": out("resumed"), "load": str(r["dpr"])},
        {"flags": MTP, "steps": 3, "out": out("mtp_resumed"), "load": str(r["mtp_dpr"])},
        {"flags": [*MTP, *FULLY], "steps": 3, "out": out("mtp_ours_resumed"), "load": str(tmp / "mtp_ours")},
        {"flags": TP2, "steps": 3, "out": out("ours_tp2_resumed"), "load": str(tmp / "ours_tp2")},
        # then one process: our TP1 conversion and Megatron's re-save resumed, and a run saved in 4 buckets
        {"flags": tp1, "steps": 3, "out": out("ours_tp1_resumed"), "load": str(tmp / "ours_tp1"), "world": 1},
        {"flags": tp1, "steps": 3, "out": out("resave_tp1_resumed"), "load": str(r["resave"]), "world": 1},
        {"flags": [*FLAGS, "--overlap-grad-reduce", "--ddp-bucket-size", "20000"], "steps": 2, "out": out("buckets"),
         "save": str(tmp / "buckets"), "world": 1}], 2)
    r["buckets"] = tmp / "buckets"
    for name in ("resumed", "ours_tp2_resumed", "ours_tp1_resumed", "resave_tp1_resumed", "mla_dpr", "mla_fully",
                 "mtp_dpr", "mtp_fully", "mtp_resumed", "mtp_ours_resumed"):
        r[f"losses_{name}"] = json.loads(Path(out(name)).read_text())["losses"]
    r["resumed"] = r["losses_resumed"]
    return r


def convert(src: Path, dst: Path, *extra: str) -> str:
    return run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--training-state", *extra, "--load-dir", src,
                   "--save-dir", dst)


def assert_same_moments(a, b) -> None:
    assert sorted(a.tensors) == sorted(b.tensors) == ["exp_avg", "exp_avg_sq", "fp32_param"]
    for moment, tensors in a.tensors.items():
        assert sorted(tensors) == sorted(b.tensors[moment])
        for name, t in tensors.items():
            assert torch.equal(t.load(), b.tensors[moment][name].load()), (moment, name)


def test_read_as_megatron_reshards_it(megatron):
    """Both types read into the IR hold, value for value, what Megatron's own fully_reshardable re-save holds;
    the step, groups, schedule and position are the source's. Independently of Megatron's re-save: each bf16
    weight is its fp32 master weight rounded (Megatron copies the masters into the model after each step), which
    a window on the wrong place of a buffer would break."""
    dpr = engine.load(megatron["dpr"], STATE)
    dz, resave = engine.load(megatron["dz"], STATE), engine.load(megatron["resave"], STATE)
    assert (dpr.training.optimizer_kind, dz.training.optimizer_kind) == ("dp_reshardable", "dp_zero_gather_scatter")
    assert_same_moments(dpr.training, resave.training)
    assert_same_moments(dz.training, resave.training)  # TP2 x DP1 trained as TP2 x DP2: the same numbers
    for name, weight in dpr.tensors.items():
        assert torch.equal(dpr.training.tensors["fp32_param"][name].load().to(torch.bfloat16), weight.load()), name
    t = dpr.training
    assert (t.step, t.iteration, t.consumed_samples, t.rng_layout) == (3, 3, 12, (2, 1))
    assert t.scheduler == resave.training.scheduler == dz.training.scheduler
    assert t.param_groups == dz.training.param_groups == resave.training.param_groups and len(t.param_groups) == 2


def test_resumed_under_tp2_as_the_original(megatron):
    """dp_reshardable -> fully_reshardable (TP2: RNG kept; converted and resumed in the fixture's last launch):
    resumed under TP2 x DP1, the losses of Megatron resuming its dp_reshardable checkpoint there."""
    out = megatron["ours_tp2_output"]
    assert "written as 'fully_reshardable'" in out and "RNG state dropped" not in out
    assert megatron["losses_ours_tp2_resumed"] == megatron["resumed"]


def test_resumed_under_tp1_as_megatron_reshards_it(megatron):
    """dp_reshardable (TP2 x DP2) -> TP1 (converted and resumed in the fixture's last launch): resumed by a
    one-process run, the losses of Megatron resharding its own fully_reshardable re-save to TP1 (TP1 sums the
    row-parallel layers in another order than TP2: TP1 is compared with TP1)."""
    assert "RNG state dropped" in megatron["ours_tp1_output"]
    assert megatron["losses_ours_tp1_resumed"] == megatron["losses_resave_tp1_resumed"]


def test_read_from_several_buckets(megatron):
    """--overlap-grad-reduce with --ddp-bucket-size 20000 (trained in the fixture's last launch): Megatron cuts the
    chunk's buffer into 4 buckets, one stored tensor each; every bf16 weight read is its fp32 master weight rounded
    (as above)."""
    ckpt = megatron["buckets"]
    assert len([k for k in DcpReader(ckpt / "iter_0000002").tensors if k.endswith(".param")]) == 4
    ir = engine.load(ckpt, STATE)
    assert (ir.training.optimizer_kind, ir.training.step) == ("dp_reshardable", 2)
    for name, weight in ir.tensors.items():
        assert torch.equal(ir.training.tensors["fp32_param"][name].load().to(torch.bfloat16), weight.load()), name


@pytest.mark.parametrize("fmt, kind", [("torch_dist", "plain"), ("torch_dist", "fully_sharded_model_space"),
                                       ("torch", "fully_reshardable"), ("torch", "plain")])
def test_written_in_every_other_type(megatron, tmp_path, fmt, kind):
    """dp_zero_gather_scatter -> each type written (torch: TP2, distrib_optim.pt or the plain optimizer in the
    rank files), read back value for value."""
    run_cli("--saver", "core", "--ckpt-format", fmt, "--training-state", "--optimizer-sharding", kind, "--tp", "2",
            "--load-dir", megatron["dz"], "--save-dir", tmp_path / "out")
    source, back = engine.load(megatron["dz"], STATE).training, engine.load(tmp_path / "out", STATE).training
    assert_same_moments(source, back)
    assert (back.step, back.iteration, back.consumed_samples, back.scheduler, back.param_groups) == \
        (source.step, source.iteration, source.consumed_samples, source.scheduler, source.param_groups)


@pytest.mark.parametrize("name", ["mla", "mtp"])
def test_mla_and_mtp_read_as_megatron_saves_them(megatron, name):
    """dp_reshardable buffers of MLA models, without and with an MTP module, cut between two DP ranks. Megatron's
    parameter order differs from the `torch` table's there (MLASelfAttention registers its output projection first
    and its latent norms last; GPTModel its MTP block before the output layer, each MTP layer its final norm after
    its transformer layer). The same training as the fully_reshardable run (the same losses,
    exactly), so every value read must be the one Megatron's own fully_reshardable save holds under that
    parameter's name, and each parameter's window must fall on the stored chunks."""
    assert megatron[f"losses_{name}_dpr"] == megatron[f"losses_{name}_fully"]
    dpr, fully = engine.load(megatron[f"{name}_dpr"], STATE), engine.load(megatron[f"{name}_fully"], STATE)
    assert dpr.config.is_mla and dpr.config.mtp_layers == int(name == "mtp")
    assert "layers.0.attn.q_down.weight" in dpr.training.tensors["exp_avg"]
    assert dpr.training.optimizer_kind == "dp_reshardable"
    assert_same_moments(dpr.training, fully.training)
    assert dpr.training.param_groups == fully.training.param_groups


def test_mtp_resumed_as_the_original(megatron):
    """The MLA + MTP model's dp_reshardable -> fully_reshardable: resumed under DP2, the losses of Megatron resuming
    its own dp_reshardable checkpoint, exactly (bound 0, as above)."""
    assert megatron["losses_mtp_ours_resumed"] == megatron["losses_mtp_resumed"]


# -- bad input ---------------------------------------------------------------------------------------------------

def copy_edited(src: Path, dst: Path, *, replace: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """Megatron's checkpoint copied chunk by chunk (the chunks as Megatron stored them, the objects byte for byte),
    with tensors `replace`d (whole, one chunk) or dropped."""
    store, out = DcpReader(src / ITER), dst / ITER
    out.mkdir(parents=True)
    items = []
    for fqn, entry in store.tensors.items():
        if fqn in drop:
            continue
        if fqn in (replace or {}):
            t = replace[fqn]
            items.append(dcp_writer.Item(fqn, t.nbytes, lambda t=t: t, tuple(t.shape), (0,) * t.dim(),
                                         tuple(t.shape), t.dtype))
            continue
        whole = store.read(fqn)
        for c in entry.chunks:
            piece = whole[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))].clone()
            items.append(dcp_writer.Item(fqn, piece.nbytes, lambda p=piece: p, entry.shape, c.offsets, c.sizes,
                                         entry.dtype))
    items += [dcp_writer.Item(k, len(b), lambda b=b: b) for k in store.bytes_items for b in [store.read_bytes(k)]]
    jobs, finish = dcp_writer.plan(out, items)
    workers.run(jobs, workers=1, progress=Progress(enabled=False), finish=finish)
    (out / "metadata.json").write_bytes((src / ITER / "metadata.json").read_bytes())
    (dst / "latest_checkpointed_iteration.txt").write_text("3")
    return dst


BUCKET = "optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0"


def test_copy_is_read_as_the_original(megatron, tmp_path):
    """The copy the refusals below edit is itself read as Megatron's checkpoint."""
    src = copy_edited(megatron["dpr"], tmp_path / "src")
    assert_same_moments(engine.load(src, STATE).training, engine.load(megatron["dpr"], STATE).training)


def test_refused_buffer_of_another_size(megatron, tmp_path):
    replace = {f"{BUCKET}.{m}": torch.zeros(1000) for m in ("param", "exp_avg", "exp_avg_sq")}
    src = copy_edited(megatron["dpr"], tmp_path / "src", replace=replace)
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=("dp_group_idx_1.gbuf_idx_0", "1000", "bucket layout"))


def test_refused_buffer_not_cut_at_the_parameters(megatron, tmp_path):
    """A bucket stored whole (one chunk) cannot be checked against the parameters' places: refused."""
    store = DcpReader(megatron["dpr"] / ITER)
    replace = {f"{BUCKET}.exp_avg": store.read(f"{BUCKET}.exp_avg").clone()}
    src = copy_edited(megatron["dpr"], tmp_path / "src", replace=replace)
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=(f"{BUCKET}.exp_avg", "not stored as parameters"))


def test_refused_missing_rank(megatron, tmp_path):
    drop = tuple(f"{BUCKET}.{m}" for m in ("param", "exp_avg", "exp_avg_sq"))
    src = copy_edited(megatron["dpr"], tmp_path / "src", drop=drop)
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=("dp_reshardable buffers", "(1, 0)"))


def test_refused_writing_bucket_types(megatron, tmp_path):
    for kind in bucket_optim.KINDS:
        convert_refused(megatron["dz"], tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                        "--optimizer-sharding", kind, culprits=(f"--optimizer-sharding {kind}", "not written"))


def test_refused_models_whose_parameter_order_is_not_checked():
    """Transformer Engine's spec (and BERT models) keep their parameters in an order not checked here,
    and MoE models' expert buffers are not checked at TP > 1 (not trainable on CPU) or with expert TP other than
    TP, nor MTP modules at PP > 1: refused by name before anything is read."""
    args = SimpleNamespace(transformer_impl="transformer_engine", tensor_model_parallel_size=1,
                           pipeline_model_parallel_size=1)
    config = ModelConfig(family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                         num_query_groups=4, head_dim=16, vocab_size=256, max_position_embeddings=16)
    with pytest.raises(ConvertError, match="Transformer Engine.*--dist-ckpt-optim-fully-reshardable"):
        bucket_optim.read(None, "dp_reshardable", args, config, 256, {}, "ckpt", False)
    moe = dataclasses.replace(config, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=96)
    args = SimpleNamespace(transformer_impl="local", tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                           expert_model_parallel_size=2)
    with pytest.raises(ConvertError, match="an MoE model at TP > 1"):
        bucket_optim.read(None, "dp_reshardable", args, moe, 256, {}, "ckpt", True)
    mtp = SimpleNamespace(transformer_impl="local", tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    with pytest.raises(ConvertError, match="multi-token-prediction modules at PP > 1"):
        bucket_optim.read(None, "dp_reshardable", mtp, dataclasses.replace(config, mtp_layers=1), 256, {}, "ckpt",
                          False)
    args.tensor_model_parallel_size, args.expert_tensor_parallel_size = 1, 2
    with pytest.raises(ConvertError, match=r"expert tensor-parallel size \(2\) other than TP \(1\)"):
        bucket_optim.read(None, "dp_reshardable", args, moe, 256, {}, "ckpt", True)


def test_refused_mla_and_mtp_in_the_torch_format(megatron, tmp_path):
    """The `torch` format's optimizer state of MLA and MTP models (Megatron orders their parameters otherwise than
    our rank files; not checked for that format): refused by name, nothing written."""
    convert_refused(megatron["mtp_dpr"], tmp_path, "--ckpt-format", "torch", "--training-state",
                    culprits=("multi-latent attention and MTP modules", "--ckpt-format torch_dist"))
