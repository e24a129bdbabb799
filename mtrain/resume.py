"""What a resumed run says about itself: where it resumes, whether the layout or the learning-rate schedule
changed since the checkpoint was written, and whether there is anything left to do.

    resumed from runs/a/step_0000006 at step 6 (48 samples)
      layout: saved by 2 ranks (tp 2), now 1 rank: weights and optimizer state are resharded; RNG states are
              not restored (each belongs to a rank of the saving layout)
      learning-rate schedule: train.steps 6 -> 10 changes it: step 7 runs at lr 1.42e-04 (the saved schedule
              ended at: 5.58e-05); set optim.decay_steps 6 to keep the saved decay

The checkpoint's mtrain.json holds the layout and the whole training config it was written with (checkpoint.py).
"""

from __future__ import annotations

from typing import Any

from mtrain.config import Config, OptimConfig, build_section
from mtrain.errors import TrainError
from mtrain.optim import lr_at

SCHEDULE_FIELDS = ("lr", "min_lr", "warmup_steps", "decay_style", "decay_steps")


def finished_message(path, step: int, steps: int) -> str | None:
    """The message for a run whose checkpoint already reached train.steps (None when there is work left)."""
    if step < steps:
        return None
    return (f"nothing to do: the run in {path.parent} already finished at step {step} (train.steps {steps}; latest "
            f"checkpoint {path.name}); raise --train.steps to train further")


def resume_notes(meta: dict[str, Any], config: Config, layout: dict[str, Any], world: int) -> list[str]:
    """Lines that follow 'resumed from …': a changed layout, a changed learning-rate schedule."""
    notes = []
    saved_layout, saved_world = meta.get("parallel"), meta.get("world_size")
    source = meta.get("converted_from")
    if isinstance(source, dict):  # written by mconvert's saver `mtrain` (run_saver.py)
        notes.append(f"converted by mconvert from the {source.get('format')} checkpoint {source.get('path')} "
                     f"(iteration {source.get('iteration')}): weights, AdamW state, step and data position carried; "
                     "RNG states are not (drawn afresh)")
    elif saved_layout != layout or saved_world != world:
        notes.append(f"layout: saved by {_ranks(saved_world)} ({describe_layout(saved_layout)}), now {_ranks(world)} "
                     f"({describe_layout(layout)}): weights and optimizer state are resharded; RNG states are not "
                     "restored (each belongs to a rank of the saving layout)")
    saved = meta.get("config")
    schedule = schedule_note(meta["step"], saved if isinstance(saved, dict) else {}, config)
    if schedule:
        notes.append(schedule)
    return notes


def schedule_note(step: int, saved: dict[str, Any], config: Config) -> str | None:
    """Say how the learning-rate schedule differs from the saved run's, and what the next step's LR becomes."""
    try:
        old_optim = build_section(OptimConfig, "optim", saved.get("optim") or {})
        old_steps = int((saved.get("train") or {})["steps"])
    except (KeyError, TypeError, ValueError, AttributeError, TrainError):
        return None  # an older checkpoint without its config (or one not mtrain's): nothing to compare with
    if old_steps < 1:
        return None
    new_optim, new_steps = config.optim, config.train.steps
    changed = [f"optim.{name} {getattr(old_optim, name)} -> {getattr(new_optim, name)}" for name in SCHEDULE_FIELDS
               if getattr(old_optim, name) != getattr(new_optim, name)]
    steps_matter = old_optim.decay_steps is None or new_optim.decay_steps is None
    if old_steps != new_steps and steps_matter:
        changed.insert(0, f"train.steps {old_steps} -> {new_steps}")
    if not changed:
        return None
    old_lr = lr_at(min(step, old_steps - 1), old_optim, old_steps)  # a finished schedule stays at its end
    new_lr = lr_at(step, new_optim, new_steps)
    end = " ended at" if step >= old_steps else ""
    keep = f"; set optim.decay_steps {old_steps} to keep the saved decay" \
        if old_steps != new_steps and new_optim.decay_steps is None and len(changed) == 1 else ""
    return (f"learning-rate schedule: {', '.join(changed)} changes it: step {step + 1} runs at lr {new_lr:.2e} "
            f"(the saved schedule{end}: {old_lr:.2e}){keep}")


def describe_layout(layout: dict[str, Any] | None) -> str:
    """`tp 2, pp 2, dp 1` (the sizes above 1, and dp), or 'layout not recorded'."""
    if not layout:
        return "layout not recorded"
    sizes = [f"{k} {layout[k]}" for k in ("tp", "pp", "vpp", "ep", "cp") if (layout.get(k) or 1) > 1]
    return ", ".join(sizes + [f"dp {layout.get('dp', 1)}"])


def _ranks(n: int | None) -> str:
    return "an unknown number of ranks" if n is None else f"{n} rank{'s' if n != 1 else ''}"
