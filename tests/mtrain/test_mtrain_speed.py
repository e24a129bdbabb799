"""What makes mtrain fast must not change its numbers: fused AdamW against foreach, whole-model compilation against
eager; and what it reports about speed: model FLOPs per token, MFU / achieved FLOP/s, the bf16-on-CPU check."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mconvert.ir.config import ModelConfig
from mtrain import cpu_memory, flops, precision
from mtrain.config import OptimConfig
from mtrain.errors import TrainError
from mtrain.optim import build_optimizer, implementation
from mtrain.train import Trainer
from tests.support.models import TINY_LLAMA, TINY_MIXTRAL
from tests.support.training import tiny_config


@pytest.mark.parity
def test_fused_adamw_matches_foreach():
    """The same gradients through fused and foreach AdamW (weight decay on matrices only, LR changing every step)
    give the same weights and moments to float32 rounding: each step the two kernels compute the same update with
    the operations in another order, a few ulps of the moments (rtol 1e-6 = 8 ulps) and of an update of at most
    5e-3 (~1e-9 a step, so ~1e-8 after 20 steps, within atol 1e-7 + 8 ulps of the weight); a wrong step (bias
    correction, decay on the wrong tensors) moves a weight by ~1e-3."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
              for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [build_optimizer(m, OptimConfig(fused=f, weight_decay=0.1)) for m, f in zip(models, (True, False))]
    assert opts[0].defaults["fused"] and opts[1].defaults["foreach"] and not opts[1].defaults["fused"]
    for step in range(20):
        grads = [torch.randn_like(p) * (step + 1) for p in models[0].parameters()]
        for model, opt in zip(models, opts):
            for group in opt.param_groups:
                group["lr"] = 1e-3 * (1 + step % 5)
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            opt.step()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opts[0].state[p][key], opts[1].state[q][key], rtol=1e-6, atol=1e-9)


@pytest.mark.parity
def test_trainer_runs_fused_adamw_on_cpu_and_matches_foreach(corpus):  # noqa: F811
    """4 training steps: the updates differ by a few ulps, which Adam amplifies in near-zero gradient entries as a
    parallel layout's rounding is, so the losses and final weights are held to the bounds of the layout tests
    (tests/mtrain/parity.py: 8 x float32's own error, from a float64 run of the same steps; fused AdamW is the
    reference's, foreach the one compared)."""
    from tests.mtrain.recording import RecordingTrainer

    config = tiny_config(corpus, train={"steps": 4})
    fused = Trainer(config, out=lambda _: None)
    assert fused.optimizer.optimizers[0].defaults["fused"] is True
    fused.close()
    reference = RecordingTrainer.reference(config)
    foreach = RecordingTrainer(tiny_config(corpus, train={"steps": 4}, optim={"fused": False}))
    assert foreach.optimizer.optimizers[0].defaults["foreach"] is True
    result, record = foreach.run_and_record()
    assert result.losses != reference.result.losses  # not the same kernel
    reference.check_losses(result.losses)
    ratio, name = reference.worst(record, ("weights",))
    assert ratio <= 1, (name, ratio)


def test_fused_adamw_refused_where_pytorch_has_none():
    with torch.device("meta"):
        params = [torch.nn.Parameter(torch.empty(2, 2))]
    assert implementation(params, None) == {"foreach": True}
    with pytest.raises(TrainError, match="optim.fused is true but PyTorch has no fused AdamW for meta parameters"):
        implementation(params, True)


@pytest.mark.parity
def test_whole_model_compile_is_exact(corpus, monkeypatch):  # noqa: F811
    """train.compile model compiles the whole model in place (names unchanged). The aot_eager backend stands in for
    inductor (whose cold CPU compile takes ~20 s): Dynamo capture and AOT autograd's forward and backward graphs
    run, and the result is the same as eager to the bit, losses and weights, over several optimizer steps."""
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="aot_eager"))
    eager = Trainer(tiny_config(corpus, train={"steps": 4}), out=lambda _: None)
    compiled = Trainer(tiny_config(corpus, train={"steps": 4, "compile": "model"}), out=lambda _: None)
    assert compiled.model._compiled_call_impl is not None
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in compiled.model.layers.values())
    assert [n for n, _ in compiled.model.named_parameters()] == [n for n, _ in eager.model.named_parameters()]
    a, b = eager.run(), compiled.run()
    assert a.losses == b.losses
    for (name, p), q in zip(eager.model.named_parameters(), compiled.model.parameters()):
        assert torch.equal(p, q), name


def test_compile_mode_values(corpus):  # noqa: F811
    with pytest.raises(TrainError, match="train.compile: True is not one of none, layers, model"):
        tiny_config(corpus, train={"compile": True})


def test_flops_per_token_counts_matmuls_and_attention():
    c = ModelConfig(**TINY_LLAMA)
    h, f, nh, ng, hd, V, L = (c.hidden_size, c.ffn_hidden_size, c.num_attention_heads, c.num_query_groups,
                              c.head_dim, c.vocab_size, c.num_layers)
    per_layer = h * nh * hd + 2 * h * ng * hd + nh * hd * h + 3 * h * f  # q, k and v, o, SwiGLU gate/up/down
    assert flops.matmul_params(c) == L * per_layer + h * V
    assert flops.flops_per_token(c, 32) == 6 * (L * per_layer + h * V) + 12 * L * nh * hd * 32
    window = c.replace(sliding_window=8)  # attention over the window only
    assert flops.flops_per_token(window, 32) == 6 * (L * per_layer + h * V) + 12 * L * nh * hd * 8


def test_flops_of_moe_count_the_active_experts():
    c = ModelConfig(**TINY_MIXTRAL)
    h, hd = c.hidden_size, c.head_dim
    attention = 2 * h * c.num_attention_heads * hd + 2 * h * c.num_query_groups * hd
    expert = 3 * h * c.expert_ffn_hidden_size
    assert flops.matmul_params(c) == c.num_layers * (attention + h * c.num_experts + c.moe_top_k * expert) \
        + h * c.vocab_size


def test_throughput_reports_mfu_with_a_peak_and_flops_without():
    t = flops.Throughput(flops_per_token=1e9, devices=2, peak_tflops=100.0)
    assert t.mfu(50_000) == pytest.approx(0.25)  # 5e13 FLOP/s over 2 x 1e14 (approx: float64 divisions)
    assert t.describe(50_000) == "MFU 25.0%"
    assert t.scalars(50_000) == pytest.approx({"tflops": 50.0, "mfu": 0.25})
    cpu = flops.Throughput(flops_per_token=1e8, devices=1, peak_tflops=None)
    assert cpu.describe(1234) == "123 GFLOP/s" and cpu.scalars(1234) == pytest.approx({"tflops": 0.1234})


def test_training_log_shows_flops(corpus):  # noqa: F811
    lines = []
    Trainer(tiny_config(corpus, train={"steps": 2}, logging={"interval": 1}), out=lines.append).run()
    assert any(s.startswith("model FLOPs per token: ") and "achieved FLOP/s (no peak: on a CPU)" in s for s in lines)
    steps = [s for s in lines if s.startswith("step ")]
    assert len(steps) == 2 and all("FLOP/s |" in s for s in steps)
    lines.clear()
    Trainer(tiny_config(corpus, train={"steps": 1}, logging={"interval": 1, "peak_tflops": 1.0}),
            out=lines.append).run()
    assert any("logging MFU against 1 TFLOP/s per device (logging.peak_tflops)" in s for s in lines)
    assert any(s.startswith("step ") and "| MFU " in s for s in lines)


def test_peak_tflops_must_be_positive(corpus):  # noqa: F811
    with pytest.raises(TrainError, match="logging.peak_tflops must be positive"):
        tiny_config(corpus, logging={"peak_tflops": 0})


@pytest.mark.parametrize("slowdown, choice", [(2.0, "fp32"), (1.0, "fp32"), (0.5, "bf16")])
def test_precision_auto_on_cpu_follows_the_measurement(slowdown, choice):
    lines = []
    got = precision.resolve("auto", torch.device("cpu"), 1, lines.append, measure=lambda: slowdown)
    assert got == choice
    assert lines == [f"train.precision auto: {choice} (bf16 measured {slowdown:.1f}x "
                     + ("slower than" if slowdown > 1 else "the time of") + " fp32 on this CPU)"]


def test_bf16_on_a_slow_cpu_warns_with_the_measured_slowdown():
    lines = []
    assert precision.resolve("bf16", torch.device("cpu"), 1, lines.append, measure=lambda: 27.0) == "bf16"
    assert lines[0].startswith("warning: train.precision bf16 on a CPU without fast bf16 matrix units: bf16 "
                               "measured 27.0x slower than fp32")
    lines.clear()
    assert precision.resolve("bf16", torch.device("cpu"), 1, lines.append, measure=lambda: 0.6) == "bf16"
    assert precision.resolve("fp32", torch.device("cpu"), 1, lines.append, measure=lambda: 1 / 0) == "fp32"
    assert lines == []


def test_bf16_slowdown_is_measured():
    """The probe really times both: a positive, finite ratio (its size depends on the CPU)."""
    ratio = precision.bf16_slowdown(repeats=1)
    assert 0 < ratio < float("inf")


@pytest.mark.parity
def test_whole_model_compile_under_fsdp_and_ddp_trains_like_one_process(corpus, tmp_path):  # noqa: F811
    """Two data-parallel ranks with train.compile model (FSDP: the graph breaks at the layers' FSDP hooks; DDP)
    give the one-process eager losses, within the loss bounds of the layout tests (tests/mtrain/parity.py)."""
    from tests.mtrain.recording import RecordingTrainer
    from tests.support.launch import launch, losses

    raw = tiny_config(corpus, train={"steps": 3, "compile": "model"}).to_dict()
    specs = [{"config": raw | {"parallel": raw["parallel"] | {"dp_mode": mode}}, "out": str(tmp_path / f"{mode}.json"),
              "compile_backend": "aot_eager"} for mode in ("fsdp", "ddp")]
    launch(specs, tmp_path, nproc=2)
    reference = RecordingTrainer.reference(tiny_config(corpus, train={"steps": 3}))
    for mode in ("fsdp", "ddp"):
        reference.check_losses(losses(tmp_path / f"{mode}.json"))


def test_flops_of_deepseek_count_latent_attention_and_shared_experts(tmp_path):
    """N of a DeepSeek-V3 model (MLA with and without a query LoRA, shared experts) counted from mtrain's own
    modules: every attention matrix, a dense layer's MLP, and per MoE layer the router, top-k of the routed experts
    and the shared ones."""
    from mtrain.inference import load_model
    from tests.support.models import make_deepseek

    for name, overrides in {"query_lora": {}, "no_query_lora": {"q_lora_rank": None}}.items():
        model, ir = load_model(make_deepseek(tmp_path / name, seed=1, **overrides))
        c = ir.config

        def matrices(module) -> int:
            return sum(p.numel() for p in module.parameters() if p.dim() >= 2)

        want = c.vocab_size * c.hidden_size
        for i in range(c.num_layers):
            block = model.layers[str(i)]
            want += matrices(block.attn)
            if hasattr(block, "moe"):
                moe = block.moe
                routed = matrices(moe) - matrices(moe.shared) - matrices(moe.router)
                want += matrices(moe.router) + routed * c.moe_top_k // c.num_experts + matrices(moe.shared)
            else:
                want += matrices(block.mlp)
        assert flops.attention_params(c) == matrices(model.layers["0"].attn), name
        assert flops.matmul_params(c) == want, name
        nh, hd, dv, L = c.num_attention_heads, c.head_dim, c.v_head_dim, c.num_layers
        assert flops.flops_per_token(c, 32) == 6 * want + 6 * L * nh * (hd + dv) * 32


FAULTS_OF_FIVE_STEPS = """
import resource, sys
import torch
from mtrain import cpu_memory
if sys.argv[1] == "keep":
    assert cpu_memory.keep_freed_memory()
head = torch.nn.Linear(16, 12288, bias=False)  # logits [1024, 12288]: 48 MiB; the matmuls stay cheap
x = torch.randn(1024, 16)
def step():  # logits, their log-softmax and gradients: 48 MiB each, freed at the end of the step
    torch.nn.functional.cross_entropy(head(x), torch.zeros(1024, dtype=torch.long)).backward()
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_kept_cpu_memory_is_reused_without_page_faults():
    """Steps that allocate and free blocks of 48 MiB (12,288 pages each): glibc's default maps each afresh, so five
    steps fault every page of every block again (about 250,000 faults: 5 steps x ~4 blocks x 12,288). With
    train.cpu_malloc keep the main heap's pages are reused; what may still fault is a block that an intra-op
    thread allocates in its own arena, which glibc maps whatever mallopt says: at most one such block per step
    (0, 12,288, 24,576 or 49,152 faults were seen, by thread count and CPU kernels). So `keep` stays under
    5 x 12,288 = 61,440, a quarter of the default's count, on any machine; a regression to mapping every block
    would fault as often as the default."""
    faults = {mode: int(subprocess.run([sys.executable, "-c", FAULTS_OF_FIVE_STEPS, mode], check=True,
                                       capture_output=True, text=True).stdout)
              for mode in ("system", "keep")}
    block_pages, steps = 48 * 2**20 // 4096, 5
    assert faults["system"] > 3 * steps * block_pages  # every step faults its blocks again
    assert faults["keep"] <= steps * block_pages + 1_000  # at most one block per step (+ small allocations)


@pytest.mark.parametrize("mode,calls", [("keep", 1), ("system", 0)])
def test_trainer_keeps_cpu_memory_unless_told_not_to(corpus, monkeypatch, mode, calls):  # noqa: F811
    made = []
    monkeypatch.setattr(cpu_memory, "keep_freed_memory", lambda: made.append(1) or True)
    Trainer(tiny_config(corpus, train={"steps": 1, "cpu_malloc": mode}), out=lambda _: None).close()
    assert len(made) == calls
