"""MkDocs hook: what the Run button under each experiment needs (see
docs/assets/javascripts/run-experiment.js).

After the build it copies into the site:
- Pyodide's core (the interpreter as WebAssembly and its standard library), from
  the npm package `make` installs into build/pyodide/ (PYODIDE_VERSION in the
  Makefile), to assets/vendor/pyodide/: the site serves Python to the browser
  itself, and no page asks anything of another host;
- every experiment and engine demo, with its recorded output, to
  assets/experiments/, and an index.json that says, for each, whether it runs in
  the browser (the standard library only) or the command that runs it locally.

Without the npm package (no npm where the site was built) the site still builds;
the buttons then give the command instead.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import shutil
import sys
from pathlib import Path


def _site_hooks():
    """docs/hooks/site.py, loaded by path: its name is the standard library's `site`."""
    spec = importlib.util.spec_from_file_location(
        "book_site_hooks", Path(__file__).with_name("site.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # for its dataclasses
    spec.loader.exec_module(module)
    return module


_site = _site_hooks()
ROOT = _site.ROOT

PYODIDE = ROOT / "build" / "pyodide" / "node_modules" / "pyodide"
# What loadPyodide reads for a program that needs the standard library only.
PYODIDE_FILES = (
    "pyodide.mjs",
    "pyodide.asm.mjs",
    "pyodide.asm.wasm",
    "python_stdlib.zip",
    "pyodide-lock.json",
)
ENGINE_WHY = "This one drives the engine, which needs PyTorch: run it in a checkout, where make test sets up the .venv it uses."

log = logging.getLogger("mkdocs.hooks.run_in_page")


def entries() -> dict[str, dict]:
    """Every snippet the pages list: whether it runs in a browser, and how to run it here."""
    runner = _site._load_runner()
    found = {}
    for rel in runner.discover():
        path = ROOT / rel
        needs = _site._needs(ast.parse(path.read_text(), filename=rel), path.parent)
        stdlib = runner.EXPERIMENT.match(rel) is not None and not needs
        if stdlib:
            why, command = "It needs only Python's standard library.", f"python {rel}"
        elif runner.EXPERIMENT.match(rel):
            why, command = (
                f"It needs {', '.join(needs)}: `make test` sets up `.venv`.",
                f".venv/bin/python {rel}",
            )
        else:
            why, command = ENGINE_WHY, f".venv/bin/python {rel}"
        found[rel] = {
            "runs_here": stdlib,
            "why": why,
            "command": command,
            "source": f"assets/experiments/{rel.removeprefix('snippets/')}",
            "out": f"assets/experiments/{Path(rel).with_suffix('.out').as_posix().removeprefix('snippets/')}",
        }
    return found


def on_post_build(config) -> None:
    site = Path(config["site_dir"])
    files = entries()
    for rel, entry in files.items():
        for src, dst in (
            (rel, entry["source"]),
            (str(Path(rel).with_suffix(".out")), entry["out"]),
        ):
            if (ROOT / src).exists():
                (site / dst).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(ROOT / src, site / dst)
    vendored = PYODIDE.is_dir() and all((PYODIDE / f).exists() for f in PYODIDE_FILES)
    if vendored:
        target = site / "assets" / "vendor" / "pyodide"
        target.mkdir(parents=True, exist_ok=True)
        for name in PYODIDE_FILES:
            shutil.copyfile(PYODIDE / name, target / name)
    else:
        log.info("Pyodide is not in %s: the Run buttons give the command instead", PYODIDE)
    index = {"pyodide": vendored, "files": files}
    (site / "assets" / "experiments").mkdir(parents=True, exist_ok=True)
    (site / "assets" / "experiments" / "index.json").write_text(json.dumps(index, indent=1))
