"""Where things are: the repository, the shared Megatron-written fixtures, the helper scripts run in subprocesses."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO.parent / "shared" / "fixtures"
if not FIXTURES.is_dir():
    FIXTURES = Path(os.environ.get("MCONVERT_FIXTURES", "/work/shared/fixtures"))
MEGATRON_LM = REPO / "tests" / "megatron_lm"  # scripts run inside megatron-core environments
