"""mconvert.lazy: a module imported on first use, without garbage collection, its objects frozen out of it."""

from __future__ import annotations

import gc
import sys

from mconvert.lazy import LazyModule


def _fresh(name: str) -> None:
    sys.modules.pop(name, None)


def test_first_use_imports_without_collection_and_freezes():
    _fresh("fractions")
    lazy = LazyModule("fractions")
    gc.collect()  # nothing pending: a collection during the import could only come from the import
    before = gc.get_freeze_count()
    collections = [s["collections"] for s in gc.get_stats()]
    try:
        fraction = lazy.Fraction
        assert [s["collections"] for s in gc.get_stats()] == collections  # none while importing
        assert "fractions" in sys.modules
        assert gc.isenabled()  # left as it was
        assert gc.get_freeze_count() > before  # the import's objects (and what lived before) are frozen
        assert fraction(1, 3) + fraction(1, 6) == fraction(1, 2)
    finally:
        gc.unfreeze()


def test_collection_left_off_when_the_caller_turned_it_off():
    _fresh("fractions")
    lazy = LazyModule("fractions")
    before = gc.get_freeze_count()
    gc.disable()
    try:
        assert lazy.Fraction(2, 4).denominator == 2
        assert not gc.isenabled()
        assert gc.get_freeze_count() == before
    finally:
        gc.enable()
