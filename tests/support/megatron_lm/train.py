"""Train with Megatron-LM 0.19's own DDP, optimizer, scheduler, save_checkpoint and load_checkpoint on CPU.

    python tests/support/megatron_lm/train.py SPEC_JSON

SPEC_JSON is {"flags": [...], "steps": K, "out": FILE, "save": DIR or null, "load": DIR or null, "world": N,
"tokens": FILE or null}, or a list of them (run one after the other in the same processes: one start-up for
several layouts; the largest world first, a smaller one on the first ranks after it). N processes (1 by default)
are spawned with gloo: a run's TP/PP/EP ranks; batches are the same on each.
Megatron parses the flags (with `--load`: optimizer, scheduler and RNG state loaded too, unless the flags say
otherwise), wraps the GPTModel (one stage's chunks with PP/VPP) in its DistributedDataParallel, builds its
optimizer (get_megatron_optimizer: Adam, the distributed one with --use-distributed-optimizer, chained with the
experts' own at EP > 1) and its OptimizerParamScheduler, and runs K training steps from the loaded iteration (0
without --load): step i's batch depends on i alone (a seeded generator, or "tokens": a torch.save'd {iteration:
[global batch, 17] tokens} to train on at those iterations instead), so two runs that reach the same
iteration see the same data. Each step is Megatron's: zero the grad buffers, forward with labels (per-token
losses), mean, backward, finish_grad_sync, optimizer.step(), scheduler.step(global batch size). With PP > 1 the
forward and backward are Megatron's own pipeline schedule (1F1B, interleaved with virtual stages; activations and
gradients sent over gloo), global batch / micro batch micro-batches each of the whole batch, and
finalize_model_grads (a tied embedding's two gradients summed across the stages).
With "save", save_checkpoint writes the model, optimizer, scheduler and RNG state after the last step (with
"optimizer_sharding", the distributed optimizer's sharding type is that one, as the content metadata of older
Megatron-LM releases chose it: e.g. dp_zero_gather_scatter, which 0.19 still writes and reads). FILE gets
{"losses": [...], "iteration": last iteration} as JSON, from the last stage's first rank.
With `--use-megatron-fsdp` (and `--ckpt-format fsdp_dtensor`) the model is wrapped by Megatron-FSDP instead,
with the CPU stand-ins of fsdp.py beside this file.
Runs in the megatron-core 0.19 environment (scripts/megatron_envs.sh).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import cpu  # noqa: E402
import fsdp  # noqa: E402

SEQ = 16


class CudaIsCpu(torch.overrides.TorchFunctionMode):
    """Tensors Megatron creates on `device="cuda"` (loss scales, found-inf flags, norms) are made on the CPU, and
    `tensor.type()` names the CUDA type that Megatron's mixed-precision optimizer checks for."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class NoStream:
    """The CPU meaning of a CUDA stream: everything is already in order."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other) -> None:
        pass


def batch(iteration: int, vocab: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `iteration`'s tokens and labels: a function of the iteration only."""
    g = torch.Generator().manual_seed(1000 + iteration)
    data = torch.randint(0, vocab, (size, SEQ + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def main(spec_json: str) -> None:
    """One process, or `world` processes (spawned, gloo) for a model-parallel run; a list of specs runs one after
    the other in the same processes, saving their start-up. The specs of a list come in non-increasing world
    sizes: the launch spawns the first's, and where the world shrinks every rank leaves the process group, the
    first ranks form one of the new size (on a port rank 0 finds free just then) and the others are done."""
    specs = json.loads(spec_json)
    specs = specs if isinstance(specs, list) else [specs]
    worlds = [spec.get("world", 1) for spec in specs]
    assert worlds == sorted(worlds, reverse=True), f"world sizes in non-increasing order, not {worlds}"
    world = worlds[0]
    if world == 1:
        return run(0, specs, 1, None)
    torch.multiprocessing.spawn(run, args=(specs, world, free_port()), nprocs=world)


def free_port() -> str:
    """A port free now (other runs may share the machine: ask just before it is bound)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def join(rank: int, world: int, port: str | None) -> None:
    """Form the gloo process group of `world` ranks (`port`: None in a one-process launch, which finds its own)."""
    if world == 1 and port is None:
        return cpu.start_process_group()
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.distributed.init_process_group(backend="gloo", rank=rank, world_size=world)


def run(rank: int, specs: list[dict], world: int, port: str | None) -> None:
    from megatron.core import parallel_state
    from megatron.training import global_vars

    sharded = any("--use-megatron-fsdp" in spec["flags"] for spec in specs)
    if sharded:
        fsdp.patch()  # before anything imports Megatron-FSDP
    cpu.patch_cuda(fsdp.DEVICE if sharded else "cpu")
    torch.nn.Module.cuda = lambda self, *a, **k: self  # get_model moves the model to the current device
    torch.Tensor.cuda = lambda self, *a, **k: self
    if not sharded:
        torch.cuda.Stream = torch.cuda.current_stream = NoStream  # get_model wraps DDP in a CUDA stream
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    if world > 1:
        from megatron.training import arguments  # TP > 1 asks the GPU's architecture (for a CUDA setting)

        arguments.get_device_arch_version = lambda: 10
    join(rank, world, port)
    CudaIsCpu().__enter__()
    current = world
    for spec in specs:
        size = spec.get("world", 1)
        if size != current:  # a smaller world: its ranks form a process group of their own, the others are done
            found = [free_port() if rank == 0 else None]
            torch.distributed.broadcast_object_list(found, src=0)
            torch.distributed.destroy_process_group()
            if rank >= size:
                return
            join(rank, size, found[0])
            current = size
        train(rank, spec)
        parallel_state.destroy_model_parallel()
        global_vars.unset_global_variables()


def train(rank: int, spec: dict) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training import checkpointing
    from megatron.training.training import get_megatron_optimizer_config, get_model, get_optimizer_param_scheduler

    flags = [*spec["flags"], "--train-iters", "1000", "--lr-decay-iters", "1000"]
    if spec.get("save"):
        flags += ["--save", spec["save"], "--save-interval", "1000"]
    build = getattr(checkpointing._build_sharded_state_dict_metadata, "megatrons", None) or \
        checkpointing._build_sharded_state_dict_metadata  # Megatron's own, not an earlier spec's in this launch
    checkpointing._build_sharded_state_dict_metadata = build
    if spec.get("optimizer_sharding"):
        def chosen(*a, **k):
            return build(*a, **k) | {"distrib_optim_sharding_type": spec["optimizer_sharding"]}

        chosen.megatrons = build
        checkpointing._build_sharded_state_dict_metadata = chosen
    if spec.get("load"):
        flags += ["--load", spec["load"]]
    args = cpu.megatron_args(flags)
    cpu.init_parallel(args)
    torch.manual_seed(args.seed)  # as initialize_megatron's _set_random_seed: the same initial weights every run
    model = get_model(lambda pre_process=True, post_process=True, vp_stage=None, **_: cpu.build_model(
        args, pre_process, post_process, vp_stage), ModelType.encoder_or_decoder, wrap_with_ddp=True)
    config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(config, model, overrides)
    scheduler = get_optimizer_param_scheduler(optimizer)
    iteration = 0
    if spec.get("load"):
        # torch's Adam (no Transformer Engine or Apex here) creates its state at the first step, and the
        # distributed optimizer's state_dict needs it: Megatron's own dummy step creates it (the load replaces it).
        # Its loader then copies every state tensor of torch's Adam but `step` (set from the param groups, not
        # stored per parameter) out of the loaded ones, which have no `step`: looked up as None, which it skips
        # (with Transformer Engine's FusedAdam, what runs on GPUs, the state has no `step` tensor to look up).
        # The dp_reshardable loader's tensors do hold a `step`: the loading optimizer's own (its per-parameter
        # state, a non-persistent entry of the sharded state dict), taken before the param groups set it, so it
        # would undo the step just loaded; it is dropped, as it is absent on GPUs.
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            if hasattr(inner, "_init_optimizer_states_with_dummy_values"):
                inner._init_optimizer_states_with_dummy_values()
                load_states = type(inner)._set_main_param_and_optimizer_states
                type(inner)._set_main_param_and_optimizer_states = \
                    lambda self, param, tensors, f=load_states: f(self, param, collections.defaultdict(
                        lambda: None, {k: v for k, v in tensors.items() if k != "step"}))
        iteration, _ = checkpointing.load_checkpoint(model, optimizer, scheduler, strict=True)
    losses = []
    s = SEQ
    positions = torch.arange(s).expand(args.global_batch_size, s)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    given = torch.load(spec["tokens"], weights_only=True) if spec.get("tokens") else {}
    pipelined = args.pipeline_model_parallel_size > 1
    if pipelined:  # Megatron's own schedule carries activations and gradients between the stages (gloo p2p)
        model_config = model[0].config
        model_config.grad_scale_func = optimizer.scale_loss
        model_config.finalize_model_grads_func = finalize_model_grads  # also sums a tied embedding's gradients
    for _ in range(spec["steps"]):
        tokens, labels = batch(iteration, args.vocab_size, args.global_batch_size)
        if iteration in given:
            tokens, labels = given[iteration][:, :-1].contiguous(), given[iteration][:, 1:].contiguous()
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        for chunk in model:
            chunk.train()
        if pipelined:
            def forward_step(_, chunk):
                out = chunk(tokens, positions, causal, labels=labels)
                return out, lambda out: (out.float().mean(), {"loss": out.float().mean().detach()})

            found = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=[None] * len(model),
                                                model=model,
                                                num_microbatches=args.global_batch_size // args.micro_batch_size,
                                                seq_length=s,
                                                micro_batch_size=args.global_batch_size, forward_only=False)
            loss = found[0]["loss"] if found else torch.zeros(())
        else:
            loss = model[0](tokens, positions, causal, labels=labels).float().mean()
            loss.backward()
            for chunk in model:
                chunk.finish_grad_sync()
        ok, _, _ = optimizer.step()
        assert ok, "Megatron skipped the step"
        scheduler.step(increment=args.global_batch_size)
        iteration += 1
        args.consumed_train_samples = iteration * args.global_batch_size
        losses.append(loss.item())
    if spec.get("save"):
        checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 0)
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0 and \
            parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_expert_model_parallel_rank() == 0:
        Path(spec["out"]).write_text(json.dumps({"losses": losses, "iteration": iteration}))
    print(f"rank {rank} trained to iteration {iteration}: {losses}", flush=True)


if __name__ == "__main__":  # the async checkpoint writer spawns processes that re-import this module
    main(*sys.argv[1:])
