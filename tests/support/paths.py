"""Where things are: the repository, the shared Megatron-written fixtures, the helper scripts run in subprocesses."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO.parent / "shared" / "fixtures"
if not FIXTURES.is_dir():
    FIXTURES = Path(os.environ.get("MCONVERT_FIXTURES", "/work/shared/fixtures"))
SCRIPTS = REPO / "tests" / "support" / "scripts"  # run in subprocesses, some inside megatron-core environments
MEGATRON_LM = REPO / "tests" / "support" / "megatron_lm"  # run inside Megatron-LM 0.19's environment
