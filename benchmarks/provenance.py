"""The commit a benchmark result names: ``$TESSERA_COMMIT`` where the runner sets it (benchmarks/gpu/run.sh, from
.gpucache/COMMIT: a copy of the tree on a GPU host may carry a stale git repository of its own), else git's HEAD."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def current_commit() -> str:
    """40 hex digits, or "unknown" outside a git checkout without ``$TESSERA_COMMIT``."""
    if os.environ.get("TESSERA_COMMIT"):
        return os.environ["TESSERA_COMMIT"]
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return out or "unknown"
