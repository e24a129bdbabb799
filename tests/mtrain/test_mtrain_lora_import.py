"""PEFT adapters into mconvert and mtrain: written by the real `peft` package, merged into any base on the way to
Megatron (`--merge-adapter`), continued by a finetune (`lora.from`); adapters we cannot compute are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from mtrain.errors import TrainError
from mtrain.inference import load_model
from mtrain.train import Trainer
from tests.support.cli import mtrain, run_cli
from tests.support.models import make_hf, save_hf
from tests.support.training import RUN, tiny_config

peft = pytest.importorskip("peft")

TOKENS = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A Llama base and a PEFT adapter on it with random A and B (init_lora_weights=False: B is not zero), on the
    attention and MLP projections, saved by PEFT itself."""
    tmp = tmp_path_factory.mktemp("peft_import")
    base = save_hf("llama", tmp / "base", seed=4)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False, task_type="CAUSAL_LM")
    model = peft.get_peft_model(make_hf("llama", seed=4), config)
    model.save_pretrained(tmp / "adapter")
    return tmp, base, model


@pytest.mark.parity
def test_merge_adapter_into_megatron_equals_peft_merge_and_unload(adapter):
    tmp, base, model = adapter
    run_cli("--saver", "core", "--tp", "2", "--load-dir", base, "--merge-adapter", tmp / "adapter",
            "--save-dir", tmp / "core")
    merged = model.merge_and_unload()
    merged.save_pretrained(tmp / "peft_merged")
    # both compute W + (B @ A) * scale in float32: the Megatron checkpoint holds PEFT's merge to the bit
    assert run_cli("compare", tmp / "core", tmp / "peft_merged").rstrip().endswith("tensors bit-identical")


@pytest.mark.parity
def test_a_finetune_continues_from_a_peft_adapter(adapter, corpus):  # noqa: F811
    """The model a finetune starts with is PEFT's: base + s B A unmerged in both, the same sums in other orders
    (float32 logits below ~2: a few ulps, measured 2e-7; 1e-5 leaves a factor > 10)."""
    tmp, base, model = adapter
    trainer = Trainer(tiny_config(corpus, model=None, checkpoint={"finetune": str(base)},
                                  lora={"from": str(tmp / "adapter")}, train={"steps": 2}), out=lambda _: None)
    assert (trainer.lora.rank, trainer.lora.alpha, trainer.lora.target_names) == (4, 8.0, ("q", "v", "down"))
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(trainer.model(TOKENS), model.eval()(TOKENS).logits, atol=1e-5, rtol=1e-5)
    result = trainer.run()
    assert result.losses[2] != result.losses[1]
    out = mtrain("finetune", "--load", base, "--lora.from", tmp / "adapter", "--data.paths", corpus,
                 "--train.steps", "1", "--checkpoint.dir", tmp / "cli", *RUN)
    assert f"LoRA adapters from {tmp / 'adapter'}" in out and "LoRA: rank 4, alpha 8 (scale 2) on q,v,down" in out
    out = mtrain("finetune", "--load", base, "--lora.from", tmp / "adapter", "--data.paths", corpus,
                 "--train.steps", "2", "--checkpoint.dir", tmp / "cli", *RUN)  # the same command resumes the run
    assert f"resumed from {tmp / 'cli' / 'step_0000001'} at step 1" in out


def edited(tmp, name, **changes):
    """A copy of the adapter with adapter_config.json changed."""
    import shutil

    out = tmp / name
    shutil.copytree(tmp / "adapter", out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps(config | changes))
    return out


REFUSED = [
    ({"use_dora": True}, "use_dora=True is not supported (plain LoRA only: no DoRA, no per-layer ranks or alphas, no "
                         "trained biases or extra modules, Linear weights stored [out, in])"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported (only LORA adapters)"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern={'q_proj': 8} is not supported"),
    ({"lora_alpha": 0}, "lora_alpha must be a number > 0, got 0"),
]


@pytest.mark.parametrize(("changes", "message"), REFUSED, ids=["dora", "ia3", "rank_pattern", "alpha0"])
def test_adapters_we_do_not_compute_are_refused(adapter, tmp_path, changes, message):
    tmp, base, _ = adapter
    bad = edited(tmp, f"bad_{tmp_path.name}", **changes)
    out = run_cli("--saver", "core", "--load-dir", base, "--merge-adapter", bad, "--save-dir", tmp_path / "x",
                  expect_error=True)
    assert out.startswith(f"Error: {bad / 'adapter_config.json'}: {message}")
    assert not (tmp_path / "x").exists()


def test_an_adapter_for_another_base_is_refused(adapter, tmp_path, corpus):  # noqa: F811
    tmp, _, _ = adapter
    base_files = {p.name: p.read_bytes() for p in sorted((tmp / "base").iterdir()) if p.is_file()}
    wider = save_hf("llama", tmp_path / "wider", seed=1, hidden_size=128)  # other shapes
    out = run_cli("--saver", "core", "--load-dir", wider, "--merge-adapter", tmp / "adapter", "--save-dir",
                  tmp_path / "x", expect_error=True)
    assert out.startswith(f"Error: --merge-adapter {tmp / 'adapter'} does not fit the base model (an adapter for "
                          "another base): ")
    assert ("layers.0.attn.q.weight is [128, 128] in the base; its A is [4, 64] and B [64, 4] (rank 4 needs A "
            "[4, 128] and B [128, 4])") in out
    shallow = save_hf("llama", tmp_path / "shallow", seed=1, num_hidden_layers=1)  # names it does not have
    with pytest.raises(TrainError, match=r"^lora.from .* adapts layers.1.mlp.down.weight, layers.1.attn.q.weight, "
                                         r"layers.1.attn.v.weight, which the base model \(llama, 1 layers\) does not "
                                         r"have: an adapter for another base$"):
        Trainer(tiny_config(corpus, model=None, checkpoint={"finetune": str(shallow)},
                            lora={"from": str(tmp / "adapter")}), out=lambda _: None)
    gpt2 = save_hf("gpt2", tmp_path / "gpt2")
    out = run_cli("--saver", "core", "--load-dir", gpt2, "--merge-adapter", tmp / "adapter", "--save-dir",
                  tmp_path / "y", expect_error=True)
    assert out.startswith("Error: PEFT adapters: the gpt2 family is not supported")
    with pytest.raises(TrainError, match=r"^lora.rank 8 contradicts lora.from .*, whose adapters have rank 4"):
        Trainer(tiny_config(corpus, model=None, checkpoint={"finetune": str(tmp / "base")},
                            lora={"from": str(tmp / "adapter"), "rank": 8}), out=lambda _: None)
    # nothing written by the refused conversions, and the base itself untouched by all of this
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    assert {p.name: p.read_bytes() for p in sorted((tmp / "base").iterdir()) if p.is_file()} == base_files
    model, ir = load_model(tmp / "base")  # and still loads as a plain model, no adapters
    assert ir.adapter is None and sum(p.numel() for p in model.parameters()) > 0


FAMILY_TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                  "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                  "qwen3_moe": ["q_proj", "v_proj"],
                  "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
                  "gemma3_text": ["q_proj", "v_proj", "gate_proj"]}


@pytest.mark.parametrize("family", list(FAMILY_TARGETS))
def test_peft_names_of_each_family_round_trip(family, tmp_path):
    """An adapter PEFT writes for the family, read (--merge-adapter) and written again by the peft saver: the same
    tensor names, shapes and values, and the same target_modules, so PEFT loads ours where it loads its own."""
    from safetensors.torch import load_file

    base = save_hf(family, tmp_path / "base", seed=1)
    torch.manual_seed(0)
    model = peft.get_peft_model(make_hf(family, seed=1), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=FAMILY_TARGETS[family], init_lora_weights=False, task_type="CAUSAL_LM"))
    model.save_pretrained(tmp_path / "theirs")
    run_cli("--saver", "peft", "--load-dir", base, "--merge-adapter", tmp_path / "theirs", "--save-dir",
            tmp_path / "ours")
    theirs, ours = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("theirs", "ours"))
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    config = {d: json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("theirs", "ours")}
    assert config["ours"]["target_modules"] == sorted(config["theirs"]["target_modules"])
    peft.PeftModel.from_pretrained(make_hf(family, seed=1), tmp_path / "ours")  # loads without a missing key


def test_an_adapter_on_moe_experts_is_refused(tmp_path):
    """PEFT's target down_proj reaches transformers 5's fused experts of a Qwen3-MoE layer too: not built here."""
    base = save_hf("qwen3_moe", tmp_path / "base", seed=1)
    peft.get_peft_model(make_hf("qwen3_moe", seed=1), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["down_proj"], task_type="CAUSAL_LM")).save_pretrained(tmp_path / "a")
    out = run_cli("--saver", "core", "--load-dir", base, "--merge-adapter", tmp_path / "a", "--save-dir",
                  tmp_path / "x", expect_error=True)
    assert out.startswith(f"Error: {tmp_path / 'a' / 'adapter_model.safetensors'}: ")
    assert "mlp.experts.lora_A.weight" in out
    assert out.rstrip().endswith(": LoRA on the experts of MoE layers is not supported (adapters on the attention "
                                 "and dense MLP projections are)")


def test_an_adapter_linking_out_of_its_directory_is_refused(adapter, tmp_path):
    tmp, base, _ = adapter
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "adapter_config.json").write_bytes((tmp / "adapter" / "adapter_config.json").read_bytes())
    (linked / "adapter_model.safetensors").symlink_to(tmp / "adapter" / "adapter_model.safetensors")
    out = run_cli("--saver", "core", "--load-dir", base, "--merge-adapter", linked, "--save-dir", tmp_path / "x",
                  expect_error=True)
    assert out.startswith(f"Error: {linked}: adapter_model.safetensors is a symbolic link to "
                          f"{tmp / 'adapter' / 'adapter_model.safetensors'}, outside the checkpoint directory")


@pytest.mark.parity
def test_an_rslora_adapter_merges_as_peft_merges_it(tmp_path):
    """use_rslora: scale alpha / sqrt(r) (math.sqrt, as PEFT): the merge equals PEFT's to the bit (float32)."""
    base = save_hf("llama", tmp_path / "base", seed=2)
    torch.manual_seed(1)
    model = peft.get_peft_model(make_hf("llama", seed=2), peft.LoraConfig(
        r=8, lora_alpha=5, use_rslora=True, target_modules=["k_proj", "up_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    run_cli("--saver", "llama_mistral", "--load-dir", base, "--merge-adapter", tmp_path / "adapter", "--save-dir",
            tmp_path / "ours")
    model.merge_and_unload().save_pretrained(tmp_path / "theirs")
    assert run_cli("compare", tmp_path / "ours", tmp_path / "theirs").rstrip().endswith("tensors bit-identical")
