"""Declared sizes against what the files hold, before anything is built per layer or per expert.

A config is a few hundred bytes; what it declares is not bounded by them. `num_hidden_layers: 1000000` (or a
million experts) in a 1 KB config.json next to a 100 KB weights file made readers build a million layers' worth
of names, rows and modules, gigabytes, before the first error. The files bound the model: every layer and every
expert holds at least one value of the weights, and a faithful checkpoint holds at least every value of the model
its config describes (padded vocabularies, replicated norms and copies only add). So, in two steps:

- `check_counts`: the raw counts a reader would loop over (layers, experts, MTP modules), each at most the
  number of values stored, checked on the raw config before a reader turns it into per-layer tuples;
- `check_fits`: the exact number of values the IR config implies (`names.num_elements`, by arithmetic) at most
  twice the number stored (`SLACK`), checked before the tables are expanded per layer and expert.

Both cost nothing per layer, and refuse before memory is spent; the strict name-by-name comparison of the tensors
with the config comes after, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mconvert.errors import ConvertError
from mconvert.ir.config import ModelConfig
from mconvert.ir.names import num_elements


def stored_elements(shapes: Iterable[Sequence[int]]) -> int:
    """The number of values in tensors of these shapes (one shape per stored tensor, TP pieces each counted)."""
    total = 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= int(s)
        total += n
    return total


def check_counts(values: Mapping[str, Any], names: Iterable[str], stored: int, where: str, label: str = "") -> None:
    """Each of `names` in `values` that is a whole number must be at most `stored` (every layer, expert or MTP
    module holds at least one value); other kinds are left to the readers' own checks."""
    bad = [f"{label}{name}={values[name]}" for name in names
           if isinstance(values.get(name), int) and not isinstance(values.get(name), bool) and values[name] > stored]
    if bad:
        raise ConvertError(f"{where}: {', '.join(bad)}, but the checkpoint's files hold only {stored:,} values in "
                           "all: the config declares more than the files hold")


# A config a little larger than its files (a stack of experts one short, a missing layer) is left to the strict
# comparison after, which names the tensors; this check is for configs far beyond their files, and refuses them
# before the per-layer work, which costs a few hundred bytes per tensor: twice the values stored still bounds it.
SLACK = 2


def check_fits(config: ModelConfig, stored: int, where: str, *, mtp: bool = True) -> None:
    """The model `config` describes must not hold far more values than the checkpoint's files (`stored`). `mtp=False`
    leaves the MTP modules out, for readers that count them from the tensors (DeepSeek's config.json announces one
    that a saved model may lack)."""
    declared = num_elements(config if mtp or not config.mtp_layers else config.replace(mtp_layers=0))
    if declared > SLACK * stored:
        experts = f", {config.num_experts:,} experts" if config.is_moe else ""
        mtp = f", {config.mtp_layers} MTP modules" if config.mtp_layers else ""
        raise ConvertError(f"{where}: the config declares a model of {declared:,} values ({config.num_layers:,} "
                           f"layers{experts}{mtp}, hidden size {config.hidden_size:,}, vocabulary "
                           f"{config.vocab_size:,}), but the checkpoint's files hold only {stored:,}: the config "
                           "declares more than the files hold")
