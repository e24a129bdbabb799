"""mconvert.lazy: a module imported on first use, without garbage collection, its objects frozen out of it."""

from __future__ import annotations

import gc
import os
import subprocess
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


def _numpy_through_lazy(env: dict) -> str:
    code = ("import os; from mconvert.lazy import np; np.zeros(1); "
            "print(len(os.listdir('/proc/self/task')), os.environ.get('OPENBLAS_NUM_THREADS'))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.split()


def test_numpy_loads_with_one_blas_thread_and_leaves_no_setting():
    """numpy through mconvert.lazy: OpenBLAS starts no thread pool (its idle threads busy-wait: CPU for nothing),
    and OPENBLAS_NUM_THREADS is taken back (children do not inherit it); a user's own setting is left alone."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    assert _numpy_through_lazy(env) == ["1", "None"]  # the main thread only
    assert _numpy_through_lazy({**env, "OPENBLAS_NUM_THREADS": "2"})[1] == "2"
