"""The engine stays a standalone library: no Django anywhere in inference/."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_module_in_inference_imports_django():
    offenders = []
    for path in (ROOT / "inference").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            if any(n == "django" or n.startswith("django.") for n in names):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_importing_the_engine_loads_no_django():
    code = "import sys, inference; from inference import LLM, SamplingParams; print('django' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
