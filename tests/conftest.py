"""Shared test helpers: the repository root and the snippet runner."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"


def load_runner():
    """snippets/_runner.py is a script, not a package; load it by path."""
    spec = importlib.util.spec_from_file_location(
        "snippet_runner", ROOT / "snippets" / "_runner.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
