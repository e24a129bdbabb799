"""Megatron-Bridge (`iter_*/run_config.yaml`) and NeMo 2 (`context/` + `weights/`) checkpoints, both ways.

Without Megatron-Bridge: our torch_dist output with Megatron-LM's args removed from its common state is what
Bridge writes (its config only in run_config.yaml), so reading it back checks that the run_config.yaml we write
says the whole model, family by family; crafted configs check that nothing in them runs. With Bridge's own
environment (scripts/bridge_env.sh), Bridge exports our output and we read Bridge's import, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from mconvert import engine
from mconvert.io.dcp import DcpReader
from mconvert.io.torch_pickle import safe_load
from mconvert.options import Options
from mtrain.inference import load_model
from tests.support.cli import run_cli
from tests.support.compare import assert_same_files, assert_same_tensors, ir_tensors
from tests.support.models import make_deepseek, make_hf_model
from tests.support.paths import REPO
from tests.support.refusals import convert_refused, refused

BRIDGE_ENV = REPO / ".venv-bridge-0.6"
DRIVER = REPO / "tests" / "support" / "bridge" / "driver.py"
NEMO_LLAMA = "nemo.collections.llm.gpt.model.llama.Llama31Config8B"


def to_dist(src: Path, out: Path, *extra: str) -> Path:
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", *extra, "--load-dir", src, "--save-dir", out)
    return out / "iter_0000001"


def without_args(it_dir: Path) -> Path:
    """Megatron-LM's args taken out of the common state, as Megatron-Bridge saves it; the integrity manifest goes
    too (its digest of common.pt no longer holds)."""
    common = safe_load(it_dir / "common.pt", mmap=False)
    del common["args"]
    torch.save(common, it_dir / "common.pt")
    (it_dir / "integrity.json").unlink()
    return it_dir


def same_model(a: Path, b: Path) -> None:
    """Same tensors bit for bit, and the same config but for what Megatron-LM's args alone carry (special token
    ids), the padding (the HF side has none) and an absent auxiliary loss (None in HF, 0.0 in Megatron)."""
    assert_same_tensors(ir_tensors(a), ir_tensors(b))
    ca, cb = engine.load(a, Options()).config, engine.load(b, Options()).config
    unsaid = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None, padded_vocab_size=None)
    assert dataclasses.replace(ca, **unsaid, moe_aux_loss_coeff=ca.moe_aux_loss_coeff or 0.0) == \
        dataclasses.replace(cb, **unsaid, moe_aux_loss_coeff=cb.moe_aux_loss_coeff or 0.0)  # None: no aux loss


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3",
                                    "glm4_moe", "gpt_oss"])
def test_run_config_alone_says_the_whole_model(family, hf_model, tmp_path):
    src = hf_model(family)
    it_dir = without_args(to_dist(src, tmp_path / "dist"))
    same_model(src, tmp_path / "dist")
    assert "config=iter_0000001/run_config.yaml" in run_cli("inspect", tmp_path / "dist")
    assert it_dir.is_dir()


def test_mtrain_loads_a_bridge_checkpoint(bridge_like, llama_dir):
    """mtrain's `--load` path (mtrain.inference.load_model) on the Bridge-like checkpoint: the same model as from
    the HF source, so the same logits exactly (same weights, same code, same order of operations)."""
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = (load_model(path)[0](tokens) for path in (bridge_like, llama_dir))
    assert torch.equal(got, want)


def test_no_run_config_for_what_no_provider_builds(hf_model, tmp_path):
    """Gemma 3's sandwich norms and soft-capping are beyond megatron-core's GPT model (Megatron-LM's args keep them
    for mconvert): a Bridge provider would build another model, so no run_config.yaml is written."""
    it_dir = to_dist(hf_model("gemma3_text"), tmp_path / "dist")
    assert not (it_dir / "run_config.yaml").exists() and (it_dir / "common.pt").is_file()


@pytest.fixture(scope="module")
def bridge_like(tmp_path_factory, hf_model) -> Path:
    """The tiny Llama as Megatron-Bridge keeps it: torch_dist, config in run_config.yaml only."""
    out = tmp_path_factory.mktemp("bridge_like") / "dist"
    without_args(to_dist(hf_model("llama"), out))
    return out


def crafted(bridge_like: Path, tmp_path: Path, edit) -> Path:
    """A copy of `bridge_like` whose run_config.yaml text is `edit(text)`."""
    out = tmp_path / "crafted"
    shutil.copytree(bridge_like, out)
    path = out / "iter_0000001" / "run_config.yaml"
    path.write_text(edit(path.read_text()))
    return out


def test_yaml_tags_are_refused_by_name_and_never_run(bridge_like, tmp_path):
    mark = tmp_path / "ran"
    out = crafted(bridge_like, tmp_path, lambda t: t.replace(
        "model:\n", f"model:\n  pwn: !!python/object/apply:os.system ['touch {mark}']\n"))
    convert_refused(out, tmp_path, culprits=("run_config.yaml: YAML tag tag:yaml.org,2002:python/object/apply:"
                                             "os.system (line", "is refused: the config is read as plain data"))
    assert not mark.exists()


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda t: t.replace("megatron.bridge.models.gpt_provider.GPTModelProvider", "os.system"),
     "model _target_ 'os.system' is not a provider mconvert maps by name"),
    (lambda t: t.replace("megatron.bridge.models.gpt_provider.GPTModelProvider",
                         "megatron.bridge.models.foo.FooModelProvider"),
     "model _target_ 'megatron.bridge.models.foo.FooModelProvider' is not a provider mconvert maps by name"),
    (lambda t: t.replace("_target_: torch.nn.functional.silu", "_target_: builtins.exec"),
     "model.activation_func names _target_ 'builtins.exec', which is refused"),
    (lambda t: t.replace("_target_: torch.nn.functional.silu", "_target_: torch.nn.functional.relu"),
     "model.activation_func 'torch.nn.functional.relu' is not an activation mconvert knows"),
    (lambda t: t.replace("  ffn_hidden_size: 128\n", "  init_method: {_target_: subprocess.Popen, _args_: [ls]}\n"
                         "  ffn_hidden_size: 128\n"),
     "model.init_method names _target_ 'subprocess.Popen', which is refused"),
    (lambda t: t.replace("model:\n", "model: 3\nx:\n"), "no 'model:' mapping"),
    (lambda t: "[1, 2", "not valid YAML"),
    (lambda t: "[" * 100_000 + "]" * 100_000, "nested too deeply for a model config"),
    (lambda t: t + "x: " + "-" * (17 << 20) + "\n", "a model config is far smaller"),
])
def test_crafted_run_configs_are_refused_by_name(bridge_like, tmp_path, edit, expected):
    convert_refused(crafted(bridge_like, tmp_path, edit), tmp_path, culprits=("run_config.yaml", expected),
                    saver="hf")


def test_padding_recorded_so_bridge_builds_the_stored_rows(llama_dir, tmp_path):
    """--tp 2 --make-vocab-size-divisible-by 128 pads 300 rows to 512 (a multiple of 128 x 2); the run_config.yaml
    records should_pad_vocab, the divisor 128 and TP 2, so Megatron's formula (Bridge's too) gives the 512 rows
    stored. Read back, the recorded rows are checked against the stored ones."""
    it_dir = without_args(to_dist(llama_dir, tmp_path / "dist", "--tp", "2", "--make-vocab-size-divisible-by", "128"))
    model = yaml.safe_load((it_dir / "run_config.yaml").read_text())["model"]
    assert (model["vocab_size"], model["should_pad_vocab"], model["make_vocab_size_divisible_by"],
            model["tensor_model_parallel_size"], model["pipeline_model_parallel_size"]) == (300, True, 128, 2, 1)
    assert engine.load(tmp_path / "dist", Options()).config.padded_vocab_size == 512
    text = (it_dir / "run_config.yaml").read_text()
    (it_dir / "run_config.yaml").write_text(text.replace("make_vocab_size_divisible_by: 128",
                                                         "make_vocab_size_divisible_by: 64"))
    error = run_cli("inspect", tmp_path / "dist", expect_error=True)
    assert "run_config.yaml: vocab_size 300 (should_pad_vocab, make_vocab_size_divisible_by) makes 384 embedding " \
           "rows, the checkpoint stores 512" in error


def test_an_alias_bomb_is_walked_once(bridge_like, tmp_path):
    """YAML aliases share one list many times (2**40 paths here): each list is checked once, and the model still
    reads (the bomb sits in a field mconvert does not use)."""
    bomb = "  bomb:\n    l0: &l0 [a, a]\n" + "".join(f"    l{i}: &l{i} [*l{i - 1}, *l{i - 1}]\n" for i in range(1, 41))
    out = crafted(bridge_like, tmp_path, lambda t: t.replace("model:\n", "model:\n" + bomb))
    assert "family" in run_cli("inspect", out)


def test_no_args_and_no_run_config_is_one_error(bridge_like, tmp_path):
    out = crafted(bridge_like, tmp_path, lambda t: t)
    (out / "iter_0000001" / "run_config.yaml").unlink()
    error = run_cli("inspect", out, expect_error=True)
    assert "the common state has no 'args' and there is no run_config.yaml (Megatron-Bridge) or " \
           "context/model.yaml or io.json (NeMo 2)" in error


def nemo2(bridge_like: Path, tmp_path: Path, target: str = NEMO_LLAMA) -> Path:
    """A NeMo 2 checkpoint of the tiny Llama: weights/ (torch_dist) and context/model.yaml (the model's config)."""
    out = tmp_path / "nemo2"
    shutil.copytree(bridge_like / "iter_0000001", out / "weights")
    model = yaml.safe_load((out / "weights" / "run_config.yaml").read_text())["model"]
    (out / "weights" / "run_config.yaml").unlink()
    (out / "context").mkdir()
    model["_target_"] = target
    (out / "context" / "model.yaml").write_text(yaml.safe_dump(
        {"_target_": "nemo.collections.llm.gpt.model.llama.LlamaModel", "config": model}))
    return out


def test_nemo2_reads_its_config_from_context_model_yaml(bridge_like, llama_dir, tmp_path):
    out = nemo2(bridge_like, tmp_path)
    assert "config=context/model.yaml" in run_cli("inspect", out)
    same_model(llama_dir, out)


def test_nemo2_weights_under_the_module_prefix(bridge_like, llama_dir, tmp_path):
    """NeMo 2 keeps the model under its MegatronParallel wrapper's name: `module.decoder.layers…`."""
    out = nemo2(bridge_like, tmp_path)
    store = DcpReader(out / "weights")
    state = {f"module.{k}": store.read(k) for k in store.tensors}
    prefixed = tmp_path / "prefixed"
    shutil.copytree(out / "context", prefixed / "context")
    with warnings.catch_warnings():  # one process, no process group: what is meant here
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(prefixed / "weights"))
    for name in ("metadata.json", "common.pt"):
        shutil.copy(out / "weights" / name, prefixed / "weights" / name)
    same_model(llama_dir, prefixed)


def test_nemo2_refusals(bridge_like, tmp_path):
    out = nemo2(bridge_like, tmp_path, target="subprocess.Popen")
    convert_refused(out, tmp_path, culprits=("context/model.yaml", "model _target_ 'subprocess.Popen' is not a "
                                             "provider mconvert maps by name"))
    (out / "context" / "model.yaml").unlink()
    refused(run_cli("inspect", out, expect_error=True),
            "neither context/model.yaml nor context/io.json: cannot tell the model shape")


def test_nemo2_model_yaml_relying_on_class_defaults(bridge_like, tmp_path):
    """NeMo records only the arguments a config class was given; what its class fixes by default is not in the
    file, and mconvert does not import NeMo to learn it: the missing fields are named."""
    out = nemo2(bridge_like, tmp_path)
    path = out / "context" / "model.yaml"
    top = yaml.safe_load(path.read_text())
    for field in ("normalization", "gated_linear_unit", "rotary_base"):
        del top["config"][field]
    path.write_text(yaml.safe_dump(top))
    convert_refused(out, tmp_path, culprits=("context/model.yaml", f"{NEMO_LLAMA} leaves normalization, "
                                             "gated_linear_unit, rotary_base to the class's defaults"))


# ---- NeMo 2's context/io.json: fiddle's JSON serialization, read as data ---------------------------------------

def pyref(path: str) -> dict:
    module, name = path.rsplit(".", 1)
    return {"type": "pyref", "module": module, "name": name}


class Fiddle:
    """Writes a model.yaml-style config as NeMo 2 writes context/io.json: root TrainerContext -> model -> config,
    each a fiddle Config whose metadata names the class it builds; lists are objects of their own."""

    def __init__(self):
        self.objects: dict = {}

    def add(self, key: str, obj: dict) -> dict:
        self.objects[key] = obj
        return {"type": "ref", "key": key}

    def config(self, key: str, target: str, fields: dict) -> dict:
        meta = self.add(f"{key}_meta", {"type": pyref("fiddle.config.BuildableTraverserMetadata"), "metadata": None,
                                        "items": [["Attr(name='fn_or_cls')", pyref(target)]]})
        items = [[f"Attr(name='{k}')", self.value(f"{key}_{k}", v)] for k, v in fields.items()]
        return self.add(key, {"type": pyref("fiddle._src.config.Config"), "items": items, "metadata": meta})

    def value(self, key: str, v):
        if isinstance(v, dict) and v.get("type") == "ref":  # already written
            return v
        if isinstance(v, dict) and set(v) == {"_target_", "_call_"}:
            return pyref(v["_target_"])
        if isinstance(v, dict):
            return self.config(key, v["_target_"], {k: x for k, x in v.items() if k != "_target_"})
        if isinstance(v, list):
            return self.add(key, {"type": pyref("builtins.list"), "metadata": None,
                                  "items": [[f"Index(index={i})", self.value(f"{key}_{i}", x)]
                                            for i, x in enumerate(v)]})
        return {"type": "leaf", "value": v, "paths": ["<root>"]}

    def dump(self, config: dict) -> dict:
        fields = {k: v for k, v in config.items() if k != "_target_"}
        model = self.config("llama_model_1", "nemo.collections.llm.gpt.model.llama.LlamaModel",
                            {"config": {"_target_": config["_target_"], **fields}})
        root = self.config("trainer_context_1", "nemo.lightning.io.pl.TrainerContext", {"model": model})
        return {"root": root, "objects": self.objects, "refcounts": {}, "version": "0.0.1"}


def nemo2_io(bridge_like: Path, tmp_path: Path, edit=lambda graph: graph) -> Path:
    """The tiny Llama as NeMo 2 with context/io.json only (`edit` may change the serialized graph)."""
    out = nemo2(bridge_like, tmp_path)
    config = yaml.safe_load((out / "context" / "model.yaml").read_text())["config"]
    (out / "context" / "model.yaml").unlink()
    (out / "context" / "io.json").write_text(json.dumps(edit(Fiddle().dump(config))))
    return out


def test_nemo2_reads_its_config_from_io_json(bridge_like, llama_dir, tmp_path):
    out = nemo2_io(bridge_like, tmp_path)
    assert "config=context/io.json" in run_cli("inspect", out)
    same_model(llama_dir, out)


def config_object(graph: dict) -> dict:
    return graph["objects"]["llama_model_1_config"]


def set_item(obj: dict, name: str, value) -> dict:
    obj["items"] = [i for i in obj["items"] if i[0] != f"Attr(name='{name}')"] + [[f"Attr(name='{name}')", value]]
    return obj


def io_edit(fn):
    def edit(graph):
        fn(graph)
        return graph
    return edit


def chain(length: int) -> dict:
    """A model config whose num_layers is a list inside a list ... `length` deep, each an object of its own."""
    objects = {"l0": {"type": pyref("builtins.list"), "items": [], "metadata": None}}
    for i in range(1, length):
        objects[f"l{i}"] = {"type": pyref("builtins.list"), "metadata": None,
                            "items": [["Index(index=0)", {"type": "ref", "key": f"l{i - 1}"}]]}
    return objects


def deep_refs(graph: dict) -> dict:
    graph["objects"] |= chain(50_000)
    set_item(config_object(graph), "num_layers", {"type": "ref", "key": "l49999"})
    return graph


CRAFTED_IO = [
    (io_edit(lambda g: g["objects"]["llama_model_1_config_meta"]["items"].__setitem__(
        0, ["Attr(name='fn_or_cls')", pyref("mconvert_pwn_mark.Config")])),
     "model _target_ 'mconvert_pwn_mark.Config' is not a provider mconvert maps by name"),
    (io_edit(lambda g: set_item(config_object(g), "activation_func", pyref("os.system"))),
     "model.activation_func names _target_ 'os.system', which is refused"),
    (io_edit(lambda g: set_item(config_object(g), "ffn_hidden_size", {"type": "ref", "key": "llama_model_1_config"})),
     "object 'llama_model_1_config' contains itself"),
    (io_edit(lambda g: set_item(config_object(g), "num_layers", {"type": "ref", "key": "nowhere"})),
     "reference to an object 'nowhere' the file does not hold"),
    (io_edit(lambda g: config_object(g).__setitem__("items", [
        i for i in config_object(g)["items"] if i[0] not in ("Attr(name='normalization')",
                                                             "Attr(name='num_query_groups')")])),
     f"{NEMO_LLAMA} leaves num_query_groups, normalization to the class's defaults"),
    (io_edit(lambda g: g["objects"]["llama_model_1"]["items"].clear()),
     "root.model (nemo.collections.llm.gpt.model.llama.LlamaModel) has no 'config' argument"),
    (io_edit(lambda g: set_item(g["objects"]["llama_model_1"], "config", {"type": "leaf", "value": 3})),
     "root.model.config is not a config object"),
    (io_edit(lambda g: g["objects"]["llama_model_1_config"].__setitem__("type", pyref("builtins.dict"))),
     "object 'llama_model_1_config': item \"Attr(name='activation_func')\" is not a key"),
    (io_edit(lambda g: g.pop("objects")), "not a fiddle serialization"),
    (deep_refs, "objects nested too deeply for a run's config"),
]


@pytest.mark.parametrize(("edit", "expected"), CRAFTED_IO, ids=["unknown-class", "os.system", "cycle",
                                                                 "dangling", "class-defaults", "no-config",
                                                                 "not-a-config", "not-a-dict", "not-fiddle",
                                                                 "deep-refs"])
def test_crafted_io_json_refused_by_name_and_never_imported(bridge_like, tmp_path, monkeypatch, edit, expected):
    """Every class io.json names stays a name: a module on the path that would leave a mark when imported is named
    as the model's class and refused, and the mark is never made."""
    mark = tmp_path / "imported"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "mconvert_pwn_mark.py").write_text(f"open({str(mark)!r}, 'w').close()\nclass Config: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    out = nemo2_io(bridge_like, tmp_path, edit)
    convert_refused(out, tmp_path, culprits=("context/io.json", expected))
    assert not mark.exists()


@pytest.mark.parametrize(("text", "expected"), [
    ("{", "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("[1, 2]", "not a fiddle serialization"),
])
def test_io_json_that_is_not_a_serialized_graph(bridge_like, tmp_path, text, expected):
    out = nemo2_io(bridge_like, tmp_path)
    (out / "context" / "io.json").write_text(text)
    convert_refused(out, tmp_path, culprits=("context/io.json", expected))


# ---- with Megatron-Bridge itself --------------------------------------------------------------------------------

def bridge(*args: str | Path, cwd: Path) -> None:
    """Megatron-Bridge 0.6.2 run by tests/support/bridge/driver.py in its own environment."""
    if not (BRIDGE_ENV / ".mconvert-env").is_file():
        pytest.skip("Megatron-Bridge environment not built: run `bash scripts/bridge_env.sh`")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([BRIDGE_ENV / "bin" / "python", "-W", "ignore", DRIVER, *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize("tp", [1, 2])
def test_bridge_exports_our_torch_dist_bit_for_bit(tp, tmp_path):
    """Bridge's AutoBridge.export_ckpt of our plain torch_dist output (the default: no vocabulary padding, 1000
    rows being a multiple of TP; Bridge exports every row it holds) gives back the HF model's tensors. Megatron-LM's
    classic divisor would have padded 1000 to 1024 (TP 1) or 1024 (TP 2): args record the divisor that pads
    nothing, 8 at TP 1 and 4 at TP 2."""
    src = make_hf_model(tmp_path / "hf", "llama", vocab_size=1000, seed=5)
    it_dir = to_dist(src, tmp_path / "dist", "--tp", str(tp))
    args = safe_load(it_dir / "common.pt", mmap=False)["args"]
    assert (args.padded_vocab_size, args.make_vocab_size_divisible_by) == (1000, 8 // tp)
    model = yaml.safe_load((it_dir / "run_config.yaml").read_text())["model"]
    assert (model["vocab_size"], model["should_pad_vocab"], model["make_vocab_size_divisible_by"]) == \
        (1000, False, 8 // tp)
    bridge("export", tmp_path / "dist", src, tmp_path / "exported", cwd=tmp_path)
    assert_same_files(src, tmp_path / "exported")


@pytest.mark.parity
def test_bridge_trains_from_our_torch_dist(tmp_path):
    """Bridge's own training entry (finetune(), tests/support/bridge/driver.py `train`: gloo, CPU stand-ins) loads
    our default torch_dist output and trains 2 steps on its mock data with finite losses; the first step's
    per-token losses (before any update) are those of our reader's model (mtrain, loaded by mconvert) on the same
    batch. Bound: both run the same float32 weights through other implementations of the same operations, so
    logits agree to ~1e-6 (below 1e-5, as for megatron-core in tests/test_megatron019_loads_ours.py); a token's
    cross entropy logsumexp(z) - z_label moves by at most 2 max|dz| = 2e-5, plus its own float32 rounding
    (~1e-6 at a loss of ~7): 3e-5. A wrong row, norm or rotary setting moves losses by > 1e-3."""
    src = make_hf_model(tmp_path / "hf", "llama", vocab_size=1000, seed=5)
    to_dist(src, tmp_path / "dist")
    bridge("train", tmp_path / "dist", src, tmp_path / "steps.pt", cwd=tmp_path)
    steps = torch.load(tmp_path / "steps.pt", weights_only=True)
    assert len(steps) == 2 and all(torch.isfinite(step["losses"]).all() for step in steps)
    first = steps[0]
    assert first["losses"].shape == first["tokens"].shape == (2, 16) and bool(first["loss_mask"].all())
    with torch.no_grad():
        logits = load_model(tmp_path / "dist")[0](first["tokens"])
    ours = torch.nn.functional.cross_entropy(logits.transpose(1, 2).double(), first["labels"], reduction="none")
    torch.testing.assert_close(first["losses"].double(), ours, atol=3e-5, rtol=0)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_we_read_what_bridge_imports(family, tmp_path):
    """Bridge's AutoBridge.import_ckpt: DeepSeek-V3 (MLA, sigmoid group routing, shared experts, a dense first
    layer, an MTP module) and Qwen3-MoE (every layer with experts: Bridge 0.6 ignores decoder_sparse_step) read
    back bit for bit."""
    src = make_deepseek(tmp_path / "hf", mtp=1) if family == "deepseek_v3" else \
        make_hf_model(tmp_path / "hf", "qwen3_moe", decoder_sparse_step=1, seed=2)
    bridge("import", src, tmp_path / "bridge", cwd=tmp_path)
    assert_same_tensors(ir_tensors(src), ir_tensors(tmp_path / "bridge"))
