"""The engine's import graph: tools and front ends sit outside the core, and
kernels below it.

The core (everything in engine/ but engine/tools/ and engine/entrypoints/) must
run without the command line, the benchmarks, the book's edition checker or the
HTTP server; the server is an entrypoint the command line starts, and needs
none of the tools; the Triton kernels must not reach up into the engine that
uses them.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

ENGINE = ROOT / "engine"


def imports(path: Path) -> set[str]:
    """Every absolute module name a file imports, at any depth (lazy imports count)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def modules(under: Path) -> list[Path]:
    return sorted(under.rglob("*.py"))


def test_no_core_module_imports_the_tools() -> None:
    offenders = [
        f"{p.relative_to(ROOT)} imports {name}"
        for p in modules(ENGINE)
        if ENGINE / "tools" not in p.parents
        for name in sorted(imports(p))
        if name == "engine.tools" or name.startswith("engine.tools.")
    ]
    assert not offenders, "\n".join(offenders)


def test_no_core_module_imports_the_front_ends() -> None:
    outside = (ENGINE / "tools", ENGINE / "entrypoints")
    offenders = [
        f"{p.relative_to(ROOT)} imports {name}"
        for p in modules(ENGINE)
        if not any(folder in p.parents for folder in outside)
        for name in sorted(imports(p))
        if name == "engine.entrypoints" or name.startswith("engine.entrypoints.")
    ]
    assert not offenders, "\n".join(offenders)


def test_the_server_needs_no_tools_and_no_transformers() -> None:
    """It renders chat templates itself (jinja2, sandboxed), as transformers does."""
    offenders = [
        f"{p.relative_to(ROOT)} imports {name}"
        for p in modules(ENGINE / "entrypoints")
        for name in sorted(imports(p))
        if name.startswith(("engine.tools", "transformers"))
    ]
    assert not offenders, "\n".join(offenders)


def test_the_router_loads_no_torch() -> None:
    """It hashes prompts with the prefix cache's hash, but runs no model."""
    code = (
        "import sys, engine.entrypoints.router; "
        "print(sorted(m for m in sys.modules if m in ('torch', 'transformers')))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_kernels_do_not_import_the_engine_above_them() -> None:
    offenders = [
        f"{p.relative_to(ROOT)} imports {name}"
        for p in modules(ENGINE / "kernels")
        for name in sorted(imports(p))
        if name.startswith("engine.") and not name.startswith("engine.kernels")
    ]
    assert not offenders, "\n".join(offenders)


def test_one_ceiling_division() -> None:
    """engine.utils.cdiv is the engine's only spelling of ceiling division."""
    offenders = [
        str(p.relative_to(ROOT))
        for p in modules(ENGINE)
        if p != ENGINE / "utils.py" and "-(-" in p.read_text()
    ]
    assert not offenders, offenders


def test_the_model_runner_knows_nothing_of_the_scheduler() -> None:
    """It reads the neutral SchedulerOutput, never the scheduler or its sequences."""
    for path in (ENGINE / "model_runner.py", ENGINE / "scheduler_output.py"):
        names = imports(path)
        assert not {n for n in names if n.startswith(("engine.scheduler.", "engine.sequence"))}
        assert "engine.scheduler" not in names, path


def test_the_output_processor_needs_only_plain_outputs() -> None:
    """The front end (Chapter 8 runs it in another process) loads no torch, no
    scheduler and no model runner."""
    code = (
        "import sys, engine.output_processor; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m in "
        "('engine.scheduler', 'engine.sequence', 'engine.model_runner')))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_step_schedules_executes_and_updates() -> None:
    """LLMEngine.step is short, and calls the three stages in order."""
    tree = ast.parse((ENGINE / "llm_engine.py").read_text())
    step = next(
        node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "step"
    )
    assert step.end_lineno - step.lineno + 1 <= 15
    calls = [
        node.func.attr
        for node in sorted(
            (n for n in ast.walk(step) if isinstance(n, ast.Call)),
            key=lambda n: (n.lineno, n.col_offset),
        )
        if isinstance(node.func, ast.Attribute)
    ]
    stages = ["schedule", "execute_model", "update_from_output", "process_outputs"]
    assert [c for c in calls if c in stages] == stages
