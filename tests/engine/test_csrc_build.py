"""The C++ operators' build (engine/csrc): a build killed halfway leaves torch's
lock file in the build folder, which torch alone would wait on forever in every
later process. The next load removes it under its own lock and goes on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine import csrc
from tests.conftest import ROOT


@pytest.mark.skipif(not csrc.load(), reason="no C++ compiler to build engine/csrc")
def test_a_lock_file_left_by_a_killed_build_does_not_hang_the_next_load() -> None:
    with csrc.build_lock(csrc.library_name()) as folder:
        (folder / "lock").touch()  # as a build killed before it finished leaves it
    code = "from engine import csrc; print(csrc.load())"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.stdout.strip() == "True", done.stderr[-2000:]
    assert not (folder / "lock").exists()
