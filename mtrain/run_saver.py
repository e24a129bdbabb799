"""Saver `mtrain`: a training checkpoint (`--training-state`) written as an mtrain run directory to resume.

    mconvert --training-state --saver mtrain --load-dir MEGATRON_RUN --save-dir RUN
    mtrain pretrain CONFIG --checkpoint.dir RUN        # resumes at the source's iteration

RUN gets `latest` and `step_{iteration}/` as mtrain's own Checkpointer writes them (checkpoint.py): DCP with
`model.*` (fp32: a mixed-precision source's master weights, which mtrain's optimizer updates), AdamW's
`optimizer.state.{param}.{exp_avg,exp_avg_sq,step}` (a MoE layer's experts stacked, as their weights, one expert's
chunk at a time) and each parameter's group settings, and mtrain.json with the
step, consumed samples, the model config and a training config holding the source's schedule, AdamW settings,
batch sizes and gradient clipping (run_state.py says how they map, and refuses what does not). mtrain's resume
compares that config with the one it runs with and says what differs. RNG states and an fp16 grad scaler do not
carry over (said in a note). Tensors are written one at a time as files are produced (mconvert.io.dcp_writer).
"""

from __future__ import annotations

import json
from pathlib import Path

from mconvert.errors import ConvertError
from mconvert.io import dcp_writer
from mconvert.io.dcp_writer import Item
from mconvert.ir.tensors import LazyTensor, ModelIR
from mconvert.options import Options
from mconvert.registry import register_saver
from mconvert.workers import run as run_jobs


@register_saver("mtrain", options=("training_state",))
def save(ir: ModelIR, out: Path, options: Options, progress) -> None:
    """An mtrain run directory that `mtrain pretrain --checkpoint.dir` resumes (needs --training-state)."""
    # the trainer (and torch.distributed.checkpoint) only when this saver runs: every conversion loads the plugins
    import torch

    from mtrain import checkpoint, run_state
    from mtrain.config import from_dict
    from mtrain.errors import TrainError

    where = f"{ir.source.path}"
    if not options.training_state or ir.training is None:
        raise ConvertError("saver mtrain writes a run to resume, its optimizer state included: give --training-state "
                           "(to start training from the weights alone: mtrain finetune --load SOURCE)")
    state = ir.training
    names = run_state.parameter_names(ir.config, where)
    optim, train = run_state.mtrain_settings(state, where)
    raw = {"optim": optim, "train": train}
    if state.run.get("seq_length"):
        raw["data"] = {"seq_len": int(state.run["seq_length"])}
    try:
        config = from_dict(raw)
    except TrainError as e:
        raise ConvertError(f"{where}: the source's settings make no valid mtrain config: {e}") from None
    step = state.iteration
    decay, no_decay = run_state.mtrain_groups(config.optim, step, config.train.steps)
    masters = state.tensors.get("fp32_param") or {}
    if masters:
        progress.note(f"mtrain's weights are the fp32 master weights (the {ir.config.dtype} weights are their "
                      "rounding); mtrain computes in bf16 with train.precision bf16")
    if state.rng is not None:
        progress.note("RNG states dropped: mtrain draws its own (each source rank's belongs to its layout)")
    if state.grad_scaler is not None:
        progress.note("fp16 grad scaler dropped: mtrain trains fp32 weights (bf16 autocast) without loss scaling")
    adam_step = torch.tensor(float(state.step))
    stacks: dict[str, list[tuple[str, int | None]]] = {}  # model parameter -> its IR tensors (experts in order)
    for ir_name, (model, expert) in names.items():
        stacks.setdefault(model, []).append((ir_name, expert))
    items = []
    for model, sources in stacks.items():
        weights = {ir_name: masters.get(ir_name, ir[ir_name]) for ir_name, _ in sources}
        items += _tensor(f"{checkpoint.MODEL_PREFIX}{model}", sources, weights)
        for moment in run_state.MOMENTS:
            items += _tensor(f"{run_state.STATE}{model}.{moment}", sources, state.tensors[moment])
        items.append(Item(f"{run_state.STATE}{model}.step", 4, lambda: adam_step.clone(), (), (), (), torch.float32))
        group = decay if len(ir[sources[0][0]].shape) >= 2 else no_decay
        items += [_object(f"{run_state.GROUPS}{model}.{k}", v) for k, v in group.items()]
    step_dir = out / checkpoint.step_name(step)
    step_dir.mkdir(parents=True, exist_ok=True)
    jobs, write_metadata = dcp_writer.plan(step_dir, items)
    meta = dict(format=checkpoint.FORMAT, version=checkpoint.FORMAT_VERSION, step=step,
                consumed_samples=int(state.consumed_samples or step * config.train.global_batch_size), world_size=1,
                parallel=None, model_config=ir.config.to_dict(), config=config.to_dict(),
                tokenizer="tokenizer" if ir.assets else None, tokenizer_from=where if ir.assets else None,
                converted_from={"format": ir.source.format, "path": where, "iteration": state.iteration})

    def finish(results: list) -> None:
        write_metadata(results)
        if ir.assets:
            (step_dir / "tokenizer").mkdir()
            for name, path in ir.assets.items():
                (step_dir / "tokenizer" / name).write_bytes(Path(path).read_bytes())
        (step_dir / checkpoint.META_FILE).write_text(json.dumps(meta, indent=2))
        (out / checkpoint.LATEST_FILE).write_text(step_dir.name + "\n")

    run_jobs(jobs, workers=options.workers, progress=progress, finish=finish)


def _tensor(fqn: str, sources: list[tuple[str, int | None]], tensors: dict[str, LazyTensor]) -> list[Item]:
    """A whole fp32 tensor, read (and cast, where the source is not fp32) when its file is written; a stacked
    expert parameter is written as one chunk per expert (one expert's tensor in memory at a time)."""
    import torch

    out = []
    for ir_name, expert in sources:
        t = tensors[ir_name]
        if t.dtype_name != "float32":
            t = t.map(lambda x: x.float(), dtype="float32")
        shape = tuple(t.shape)
        if expert is None:
            out.append(Item(fqn, t.nbytes, t.load, shape, (0,) * len(shape), shape, torch.float32))
        else:
            out.append(Item(fqn, t.nbytes, lambda t=t: t.load()[None], (len(sources), *shape),
                            (expert, *(0,) * len(shape)), (1, *shape), torch.float32))
    return out


def _object(fqn: str, value) -> Item:
    data = dcp_writer.object_bytes(value)
    return Item(fqn, len(data), lambda: data)
