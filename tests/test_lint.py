"""ruff keeps the code base in one style; `make lint` runs the same two checks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.parametrize(
    "args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"]
)
def test_ruff(args: list[str]) -> None:
    assert RUFF, "ruff is not installed; `make test` installs it"
    proc = subprocess.run([RUFF, *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cpp_sources_fit_the_page() -> None:
    """ruff does not read C++; a page shows engine/csrc excerpts at 100 columns too."""
    long = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "engine").rglob("*.cpp"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > 100
    ]
    assert not long, "C++ lines over 100 columns: " + ", ".join(long)
