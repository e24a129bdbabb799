"""Run NVIDIA Megatron-Bridge 0.6.2 itself on one CPU process (gloo), in .venv-bridge-0.6 (scripts/bridge_env.sh).

    python driver.py check                         every module the conversion path imports is importable
    python driver.py import HF_DIR OUT             AutoBridge.import_ckpt: a Megatron-Bridge torch_dist checkpoint
    python driver.py export CKPT HF_DIR OUT        AutoBridge(from HF_DIR's config).export_ckpt(CKPT) -> OUT

Never imported by the test process. Megatron-Bridge assumes CUDA and Transformer Engine in a few places that touch
no weight and no key (../shared/MEGATRON-BRIDGE-CPU.md lists each with file:line); each is replaced here, in this
process only, never in the installed package:
- `import megatron.bridge` reaches `import transformer_engine.pytorch` (peft/lora_layers.py): a stub module is
  present during that import only (nvidia-modelopt and megatron-core's layer specs are imported first, so they
  see no TE);
- the gloo process group and megatron-core's parallel state exist before any provider asks for NCCL;
- the layer spec is megatron-core's local one; MoE uses SequentialMLP and the allgather dispatcher (the grouped
  GEMM and alltoall paths need CUDA); CUDA device and RNG calls mean the CPU.
"""

from __future__ import annotations

import os
import socket
import sys
import types
import warnings

import torch


def _te_stub() -> dict[str, types.ModuleType]:
    class Anything(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            if name[:1].islower():  # a submodule (`te.pytorch.ops`)
                return Anything(f"{self.__name__}.{name}")
            return type(name, (torch.nn.Module,), {})

    return {name: Anything(name) for name in ("transformer_engine", "transformer_engine.pytorch",
                                               "transformer_engine.common", "transformer_engine.common.recipe")}


def import_bridge() -> None:
    warnings.filterwarnings("ignore")
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401  sees no TE: HAVE_TE stays False
    import megatron.training  # noqa: F401  builds layer specs at import: before the stub too
    import modelopt.torch  # noqa: F401  before the stub, or it believes TE is present

    stub = _te_stub()
    sys.modules.update(stub)
    try:
        import megatron.bridge  # noqa: F401
        import megatron.bridge.models.conversion.auto_bridge  # noqa: F401
        import megatron.bridge.training.checkpointing  # noqa: F401
        import megatron.bridge.training.model_load_save  # noqa: F401
    finally:
        for name in stub:
            sys.modules.pop(name, None)


def patch_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *a, **k: None
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.bridge.models import gpt_provider, mla_provider, model_provider
    from megatron.core.models.gpt import gpt_layer_specs

    model_provider.model_parallel_cuda_manual_seed = lambda *a, **k: None
    original_provide = gpt_provider.GPTModelProvider.provide

    def cpu_settings(self):  # local spec, CPU-friendly MoE, no fused kernels; no weight or key changes
        self.use_cpu_initialization = True
        self.moe_grouped_gemm = False
        self.moe_token_dispatcher_type = "allgather"
        self.moe_shared_expert_overlap = False
        self.moe_permute_fusion = False
        self.moe_router_fusion = False
        self.gradient_accumulation_fusion = False
        self.bias_activation_fusion = False
        self.masked_softmax_fusion = False
        self.persist_layer_norm = False
        self.apply_rope_fusion = False
        self.bias_dropout_fusion = False

    def provide(self, *args, **kwargs):
        # the local spec while the model is built; the recorded one (run_config.yaml) stays what Bridge chose
        cpu_settings(self)
        recorded = self.transformer_layer_spec
        self.transformer_layer_spec = _local_spec
        try:
            return original_provide(self, *args, **kwargs)
        finally:
            self.transformer_layer_spec = recorded

    def finalize(original):
        def run(self, *args, **kwargs):
            cpu_settings(self)
            return original(self, *args, **kwargs)
        return run

    for cls in (gpt_provider.GPTModelProvider, mla_provider.MLAModelProvider):
        cls.provide = provide
        cls.finalize = finalize(cls.finalize)  # MLA's resolves to the MLA TransformerConfig's own
    original_mtp = gpt_layer_specs.get_gpt_mtp_block_spec

    def mtp_block_spec(config, vp_stage=None):  # gpt_provider.py hard-codes use_transformer_engine=True
        if not getattr(config, "mtp_num_layers", None):
            return None
        spec = config.transformer_layer_spec(config)
        return original_mtp(config, spec, use_transformer_engine=False, vp_stage=vp_stage)

    gpt_provider.mtp_block_spec = mtp_block_spec
    _dot_product_attention_without_latent_channels()


def _local_spec(config, vp_stage=None):
    """megatron-core's local spec, layer by layer as its TE block spec would be (dense layers among MoE ones)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization,
                                      vp_stage=vp_stage)


def _dot_product_attention_without_latent_channels() -> None:
    """megatron-core 0.19.2's local DotProductAttention takes no k_channels / v_channels, which multi-latent
    attention passes (multi_latent_attention.py:214); it holds no parameter and conversion never runs it."""
    from megatron.core.transformer import dot_product_attention

    cls = dot_product_attention.DotProductAttention
    original = cls.__init__

    def init(self, *args, k_channels=None, v_channels=None, **kwargs):
        original(self, *args, **kwargs)

    cls.__init__ = init


def start_process_group() -> None:
    os.environ.setdefault("MASTER_ADDR", "localhost")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")


def main() -> None:
    command = sys.argv[1]
    import_bridge()
    if command == "check":
        print("megatron.bridge imports")
        return
    patch_cpu()
    start_process_group()
    from megatron.bridge import AutoBridge

    if command == "import":
        hf_dir, out = sys.argv[2:4]
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel()
        AutoBridge.import_ckpt(hf_dir, out)
    elif command == "export":
        ckpt, hf_dir, out = sys.argv[2:5]
        AutoBridge.from_hf_pretrained(hf_dir).export_ckpt(ckpt, out, show_progress=False)
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
