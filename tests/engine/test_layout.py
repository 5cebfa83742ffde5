"""The engine's layout and import graph: a short list of modules at the root,
one folder for each part of the step, no import cycle, tools and front ends
outside the core, kernels below it, and excerpts short enough to read on a page.

The core (everything in engine/ but engine/tools/ and engine/entrypoints/) must
run without the command line, the benchmarks, the book's edition checker or the
HTTP server; the server is an entrypoint the command line starts, and needs
none of the tools; the Triton kernels must not reach up into the engine that
uses them.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from engine.tools import import_graph
from engine.tools.import_graph import runtime_imports
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


def module_name(path: Path) -> str:
    return import_graph.module_name(path, ROOT)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def engine_import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in modules(ENGINE)}
    return {name: runtime_imports(path, set(paths)) - {name} for name, path in paths.items()}


def test_the_import_graph_has_no_cycle() -> None:
    """A cycle works only while someone remembers to import lazily; a reader
    cannot read such modules in any order."""
    cycles = import_cycles(engine_import_graph())
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_lazy_import_cycle(tmp_path: Path) -> None:
    """The guard above can fail: an import inside a function closes a cycle, one
    under TYPE_CHECKING does not."""
    a = tmp_path / "a.py"
    a.write_text("import b\n")
    b = tmp_path / "b.py"
    b.write_text("def f():\n    import a\n")
    c = tmp_path / "c.py"
    c.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n")
    known = {"a", "b", "c"}
    graph = {name: runtime_imports(tmp_path / f"{name}.py", known) for name in known}
    graph["a"] |= {"c"}
    assert import_cycles(graph) == [["a", "b"]]


def layer_rows() -> list[str]:
    """The layers, from the top down: the rows of docs/architecture.md's folder table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The folders", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(engine/[\w/.]+)` \|", section, re.M)


def row_of(module: str) -> str:
    """A module's row in that table: its folder, or itself at the root."""
    part = module.split(".")[1]
    return f"engine/{part}/" if (ENGINE / part).is_dir() else f"engine/{part}.py"


def climbs(graph: dict[str, set[str]], rows: list[str]) -> list[str]:
    """The imports that reach a row above their own (``rows`` top first). The
    package itself, whose public names load lazily, is no layer."""
    height = {row: len(rows) - i for i, row in enumerate(rows)}
    return sorted(
        f"{a} ({row_of(a)}) imports {b} ({row_of(b)})"
        for a, targets in graph.items()
        for b in targets
        if "engine" not in (a, b) and height[row_of(b)] > height[row_of(a)]
    )


def test_no_import_climbs_the_layers() -> None:
    """Every folder and root module is a row of the table, and imports only from its
    own row and those below: the folder graph has no cycle, and reads bottom-up."""
    rows = layer_rows()
    graph = engine_import_graph()
    assert {row_of(m) for m in graph if m != "engine"} == set(rows)
    found = climbs(graph, rows)
    assert not found, "\n".join(found)


def test_the_layer_check_finds_a_climb() -> None:
    """The guard above can fail: kv/ importing sched/ (as it once did, for HOLE) climbs."""
    graph = {"engine.kv.block_manager": {"engine.sched.scheduler", "engine.utils"}}
    rows = ["engine/sched/", "engine/kv/", "engine/utils.py"]
    assert climbs(graph, rows) == [
        "engine.kv.block_manager (engine/kv/) imports engine.sched.scheduler (engine/sched/)"
    ]


# The modules that may sit at engine/'s root: the public API, the config, the
# request and what a caller hands in and gets back. Every other module lives in
# the folder of its part of the step.
ROOT_MODULES = {
    "__init__.py",  # the lazy public names
    "llm.py",  # LLM, the offline API
    "sampling_params.py",  # SamplingParams, StructuredOutputsParams
    "sequence.py",  # the request, as the scheduler holds it
    "outputs.py",  # what the engine hands back
    "scheduler_output.py",  # SchedulerOutput: one step's decision, as plain data
    "stats.py",  # the counters the engine keeps
    "utils.py",  # cdiv and other one-liners
}


def test_only_the_listed_modules_sit_at_the_root() -> None:
    at_root = {p.name for p in ENGINE.glob("*.py")}
    assert at_root == ROOT_MODULES, (
        f"not listed: {sorted(at_root - ROOT_MODULES)}; missing: {sorted(ROOT_MODULES - at_root)}"
    )


MAX_EXCERPT_LINES = 40


def test_every_python_excerpt_a_page_shows_is_short() -> None:
    """A quoted function must read whole on a desktop, without scrolling."""
    manifest = json.loads((ROOT / "docs" / "edition.json").read_text())
    long = sorted(
        {
            f"{e['file']}::{e['name']} ({len(e['text'].splitlines())} lines, {e['page']})"
            for e in manifest["excerpts"]
            if e["file"].endswith(".py") and len(e["text"].splitlines()) > MAX_EXCERPT_LINES
        }
    )
    assert not long, "\n".join(long)


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
    for path in (ENGINE / "runner" / "model_runner.py", ENGINE / "scheduler_output.py"):
        names = imports(path)
        assert not {
            n for n in names if n.startswith(("engine.sched.scheduler.", "engine.sequence"))
        }
        assert "engine.sched.scheduler" not in names, path


def test_the_output_processor_needs_only_plain_outputs() -> None:
    """The front end (Chapter 8 runs it in another process) loads no torch, no
    scheduler and no model runner."""
    code = (
        "import sys, engine.core.output_processor; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m in "
        "('engine.sched.scheduler', 'engine.sequence', 'engine.runner.model_runner')))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_step_schedules_executes_and_updates() -> None:
    """LLMEngine.step is short, and calls the three stages in order."""
    tree = ast.parse((ENGINE / "core" / "llm_engine.py").read_text())
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
