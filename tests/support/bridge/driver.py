"""Run NVIDIA Megatron-Bridge 0.6.2 itself on one CPU process (gloo), in .venv-bridge-0.6 (scripts/bridge_env.sh).

    python driver.py check                         every module the conversion path imports is importable
    python driver.py import HF_DIR OUT             AutoBridge.import_ckpt: a Megatron-Bridge torch_dist checkpoint
    python driver.py export CKPT HF_DIR OUT        AutoBridge(from HF_DIR's config).export_ckpt(CKPT) -> OUT
    python driver.py train CKPT HF_DIR OUT         Bridge's finetune() of HF_DIR's provider from CKPT, 2 steps on
                                                   its mock data; OUT: the batches and per-token losses

Never imported by the test process. Megatron-Bridge assumes CUDA and Transformer Engine in a few places that touch
no weight and no key (../shared/MEGATRON-BRIDGE-CPU.md lists each with file:line); each is replaced here, in this
process only, never in the installed package:
- `import megatron.bridge` reaches `import transformer_engine.pytorch` (peft/lora_layers.py): a stub module is
  present during that import only (nvidia-modelopt and megatron-core's layer specs are imported first, so they
  see no TE);
- the gloo process group and megatron-core's parallel state exist before any provider asks for NCCL;
- the layer spec is megatron-core's local one; MoE uses SequentialMLP and the allgather dispatcher (the grouped
  GEMM and alltoall paths need CUDA); CUDA device and RNG calls mean the CPU.
Training (`train`) needs a few more, none touching a weight, a key or a loss (file:line in the installed packages):
- `training/pretrain.py` imports nvidia-resiliency-ext (not installed: its in-process restart is off): a stub
  module during that import only;
- `training/initialize.py:89-91` asserts CUDA unless `allow_no_cuda`: setup's call passes it;
  `initialize.py:147` compiles megatron-core's dataset helpers with `make` (the sdist has no Makefile; the
  extension is built already): skipped; `setup.py:276` warms fused kernels on CUDA tensors: skipped;
- `setup.py:281` (`device="cuda"`) and the like: tensor factories map a CUDA device to the CPU;
- `megatron/training/models/dist_utils.py:303-306` builds DDP under a side `torch.cuda.Stream`: a stream that
  does nothing; `gpt_step.py:266` moves the batch with `.cuda()`: it stays;
- the CUDA RNG tracker is seeded only with a GPU present (`initialize.py:869`): its `fork()` is a no-op (dropout
  is 0); `torch.cuda.memory_*` report 0.
Gradient clipping asserts CUDA tensors (megatron-core `optimizer/clip_grads.py:174`): the run sets clip_grad 0.
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


def _cpu_device(device):
    return "cpu" if device is not None and "cuda" in str(device) else device


def patch_training() -> None:
    """The stand-ins Bridge's training loop needs on a CPU (module docstring), after patch_cpu()."""
    import contextlib
    import functools

    for name in ("tensor", "zeros", "ones", "empty", "full", "rand", "randn", "arange", "randint"):
        def factory(*args, _make=getattr(torch, name), **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return _make(*args, **kwargs)
        setattr(torch, name, factory)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None

    class Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, *a):
            pass

        def synchronize(self):
            pass

    torch.cuda.Stream = Stream
    torch.cuda.current_stream = lambda *a, **k: Stream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.Tensor.cuda = lambda self, *a, **k: self
    from megatron.bridge.training import initialize, setup
    from megatron.core.tensor_parallel import random

    random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    initialize.compile_helpers = lambda: None
    setup.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    setup.set_jit_fusion_options = lambda *a, **k: None


def import_finetune():
    """megatron.bridge.training.finetune, its nvidia-resiliency-ext import answered by a stub during the import."""
    stub = {name: _te_stub()["transformer_engine"].__class__(name)
            for name in ("nvidia_resiliency_ext", "nvidia_resiliency_ext.inprocess")}
    sys.modules.update(stub)
    try:
        from megatron.bridge.training import finetune
    finally:
        for name in stub:
            sys.modules.pop(name, None)
    return finetune.finetune


def train(ckpt: str, hf_dir: str, out: str, finetune) -> None:
    """Bridge's own finetune() from our checkpoint: the provider Bridge makes of the HF config (TP 1, float32, no
    dropout), 2 steps of 2 sequences of 16 tokens of its mock data, Adam without clipping. Records each step's
    batch and per-token losses (the language model's output with labels), computed before the step's update."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedInitConfig,
        GPTDatasetConfig,
        LoggerConfig,
        RNGConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.state import GlobalState
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    seq = 16
    provider = AutoBridge.from_hf_pretrained(hf_dir).to_megatron_provider(load_weights=False)
    provider.seq_length, provider.hidden_dropout, provider.attention_dropout = seq, 0.0, 0.0
    steps: list[dict] = []

    class Recording:
        def __init__(self, it):
            self.it = it

        def __iter__(self):
            return self

        def __next__(self):
            batch = next(self.it)
            steps.append({k: batch[k].clone() for k in ("tokens", "labels", "loss_mask")})
            return batch

    def recording_step(state: GlobalState, data_iterator, model, return_schedule_plan: bool = False):
        output, loss_function = forward_step(state, Recording(data_iterator), model, return_schedule_plan)
        steps[-1]["losses"] = output.detach().clone()
        return output, loss_function

    cfg = ConfigContainer(
        model=provider,
        train=TrainingConfig(train_iters=2, global_batch_size=2, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=1000, eval_iters=0),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-4, min_lr=1e-4, clip_grad=0.0, bf16=False, fp16=False,
                                  params_dtype=torch.float32, use_distributed_optimizer=False),
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0, start_weight_decay=0.01,
                                  end_weight_decay=0.01, weight_decay_incr_style="constant"),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=False),
        dataset=GPTDatasetConfig(random_seed=1234, reset_attention_mask=False, reset_position_ids=False,
                                 eod_mask_loss=False, seq_length=seq, num_dataset_builder_threads=1, blend=None,
                                 blend_per_split=None, split="9999,8,2", dataloader_type="single", num_workers=0,
                                 skip_getting_attention_mask_from_dataset=True),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf_dir),
        checkpoint=CheckpointConfig(pretrained_checkpoint=ckpt, save=None, load=None, ckpt_format="torch_dist",
                                    load_optim=False, load_rng=False),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(distributed_backend="gloo"),
        mixed_precision=None,
    )
    finetune(cfg, recording_step)
    torch.save(steps, out)


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
    elif command == "train":
        ckpt, hf_dir, out = sys.argv[2:5]
        finetune = import_finetune()
        patch_training()
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        train(ckpt, hf_dir, out, finetune)
    elif command == "export":
        ckpt, hf_dir, out = sys.argv[2:5]
        AutoBridge.from_hf_pretrained(hf_dir).export_ckpt(ckpt, out, show_progress=False)
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
