"""Megatron-FSDP (megatron-core 0.19.2, `--use-megatron-fsdp`) on CPU processes with gloo, for the test harness.

Megatron-FSDP overlaps its all-gathers and reduce-scatters with compute on CUDA side streams and names the CUDA
device where it places its buffers. On one CPU process per rank every collective is already in order when it
returns (gloo is synchronous), so each CUDA call has an inert CPU meaning. `patch()` installs those stand-ins; it
runs before megatron.core.distributed.fsdp is imported (some modules bind torch.cuda names at import). Each says
what it replaces, as file:line under megatron/core/distributed/fsdp/ (0.19.2); the package itself is not edited:

- torch.cuda.Stream, current_stream, stream(): an inert stream whose wait_stream / synchronize do nothing and
  whose record_event gives an event that is always complete (megatron/training/training.py:1876-1896, the stream
  get_model wraps the adapter in; megatron_fsdp.py:406-407; param_and_grad_buffer.py:3843, 3969, 4029-4037, 4124,
  4131, 4217, 4251, 4317, 4533-4560).
- torch.cuda.Event: that always-complete event (record, wait, synchronize, query).
- The device: FullyShardedDataParallel (the adapter) is given the CPU as its `device` where get_model gives
  none (mcore_fsdp_adapter.py:156, which would name `cuda:N`), so MegatronFSDP places its buffers there
  (megatron_fsdp.py:232, param_and_grad_buffer.py:2011); torch.cuda.current_device() is 0, as on a one-GPU
  process, for the check that compares the two (megatron_fsdp.py:234, a warning); and torch functions asked
  for a CUDA device during the forward pass and the save (a bare index, "cuda", torch.device("cuda", 0); keyword
  `device`, or positional in Tensor.to) get the CPU (src/megatron_fsdp/utils.py:795; mixed_precision.py:346).
  (A torch-function mode is not active inside autograd's backward hooks, hence the adapter's device.)
- DeviceMesh.from_group(..., device_type="cuda") builds a CPU mesh over the same gloo groups, so DTensor's
  collectives run on gloo (mcore_fsdp_adapter.py:409, 420, 438, 449).
- torch.cuda.synchronize, empty_cache: nothing to wait for or free (param_and_grad_buffer.py:854, 1149, 2234-2236,
  2900, 3119).
- torch's Adam, which Megatron uses without Transformer Engine or Apex (megatron/core/optimizer/__init__.py:33),
  stands in for TE's FusedAdam (:14) as to which parameters have state: see `_every_state`.

Megatron-FSDP also needs einops (mcore_fsdp_adapter.py:556), which scripts/megatron_envs.sh installs.
"""

from __future__ import annotations

import torch

DEVICE = 0  # torch.cuda.current_device() of a one-GPU process (cpu.patch_cuda installs it)


class InertStream:
    """A CUDA stream on CPU: work issued on it is already done when the call returns."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else InertEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class InertEvent:
    """A CUDA event on CPU: always complete."""

    def __init__(self, *a, **k):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index names a CUDA device
    return isinstance(device, str) and device.startswith("cuda")


class CudaDevicesAreCpu(torch.overrides.TorchFunctionMode):
    """Torch functions asked for a CUDA device (keyword `device`, or a device among the positional arguments, as
    `tensor.to(torch.device("cuda:0"))`) get the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros):
            args = tuple("cpu" if isinstance(a, (torch.device, str)) and _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def patch() -> None:
    """Install the stand-ins (see the module docstring); call before importing megatron.core.distributed.fsdp."""
    torch.cuda.Stream = InertStream
    torch.cuda.Event = InertEvent
    torch.cuda.current_stream = lambda *a, **k: InertStream()
    torch.cuda.stream = lambda *a, **k: InertStream()
    torch.cuda.current_device = lambda: DEVICE
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    from torch.distributed.device_mesh import DeviceMesh

    from_group = DeviceMesh.from_group  # a staticmethod

    def cpu_from_group(group, device_type, *a, **k):
        return from_group(group, "cpu" if device_type == "cuda" else device_type, *a, **k)

    DeviceMesh.from_group = staticmethod(cpu_from_group)
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    adapter_init = mcore_fsdp_adapter.FullyShardedDataParallel.__init__

    def cpu_adapter_init(self, *a, device=None, **k):
        adapter_init(self, *a, device=device or torch.device("cpu"), **k)

    mcore_fsdp_adapter.FullyShardedDataParallel.__init__ = cpu_adapter_init
    CudaDevicesAreCpu().__enter__()
    for adam in (torch.optim.Adam, torch.optim.AdamW):
        adam.step = _every_state(adam.step)


def _every_state(step):
    """torch's Adam creates a parameter's state at its first gradient and counts its step per parameter; TE's
    FusedAdam, which GPU runs use (megatron/core/optimizer/__init__.py:14), creates every parameter's state at the
    first step, gradient or not, and counts one step per group. Under Megatron-FSDP a parameter whose shard on
    this rank is empty never has a gradient there (param_and_grad_buffer.py:3393), and the fsdp_dtensor save
    agrees on every key across the ranks (uneven_dtensor.py:51; a step stored under one name by two ranks must
    be one value): so after each step a parameter without a gradient gets FusedAdam's zero moments (empty, as its
    shard) and the step the others reached."""

    def stepped(self, *a, **k):
        out = step(self, *a, **k)
        reached = [self.state[p]["step"] for group in self.param_groups for p in group["params"]
                   if p.grad is not None]  # every group steps together
        count = reached[0] if reached else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    state = self.state[p]
                    state.setdefault("exp_avg", torch.zeros_like(p))
                    state.setdefault("exp_avg_sq", torch.zeros_like(p))
                    if count is not None:
                        state["step"] = count.clone()
        return out

    return stepped
