"""The mutation score per module, from `mutmut results --all true` on stdin.

    mutmut results --all true | python tests/mutation_score.py

A mutant is killed when a test failed on it, or it timed out or crashed the
test process. The score is killed / judged, where judged leaves out mutants
skipped or not run yet (a run of one module leaves the others unchecked). A
mutant no test ran ("no tests") counts against its module: nothing guards it.
Surviving mutants are listed under their module, for `mutmut show NAME`;
those tests/mutation_survivors.md explains as equivalent are counted apart
("explained") and not listed, so the list is what is left to kill or explain.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

KILLED = {"killed", "timeout", "segfault", "caught by type check"}
UNJUDGED = {"skipped", "not checked"}
LINE = re.compile(r"^\s*(?P<name>[\w.ǁ]+__mutmut_\d+): (?P<status>.+?)\s*$")
SURVIVORS = Path(__file__).with_name("mutation_survivors.md")


@dataclass
class Module:
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    alive: list[str] = field(default_factory=list)

    @property
    def judged(self) -> int:
        return sum(n for s, n in self.counts.items() if s not in UNJUDGED)

    @property
    def score(self) -> float:
        judged = self.judged
        killed = sum(self.counts[s] for s in KILLED)
        return killed / judged if judged else 0.0


def module_of(mutant: str) -> str:
    """engine.kv.block_manager.xǁBlockǁ__init____mutmut_1 -> engine.kv.block_manager"""
    return re.split(r"\.x[ǁ_]", mutant, maxsplit=1)[0]


def tally(lines: Iterable[str]) -> dict[str, Module]:
    modules: dict[str, Module] = defaultdict(Module)
    for line in lines:
        match = LINE.match(line)
        if not match:
            continue
        module = modules[module_of(match["name"])]
        module.counts[match["status"]] += 1
        if match["status"] not in KILLED | UNJUDGED:
            module.alive.append(f"{match['name']}: {match['status']}")
    return dict(modules)


def explained(text: str) -> set[str]:
    """The mutants a survivors file explains: under each `## module` heading,
    every backquoted mutant name (`xǁClassǁmethod__mutmut_3`, `x_function__mutmut_1`)."""
    names, module = set(), ""
    for line in text.splitlines():
        if line.startswith("## "):
            module = line[3:].strip()
        for name in re.findall(r"`(x[ǁ_][\wǁ]*__mutmut_\d+)`", line):
            names.add(f"{module}.{name}")
    return names


def report(modules: dict[str, Module], equivalent: set[str] = frozenset()) -> str:
    """The table, then each module's survivors that ``equivalent`` does not explain."""
    rows = [f"{'module':32} {'judged':>7} {'killed':>6} {'alive':>5} {'score':>6} {'explained':>9}"]
    for name, m in sorted(modules.items()):
        killed = sum(m.counts[s] for s in KILLED)
        known = sum(a.split(": ")[0] in equivalent for a in m.alive)
        score = f"{m.score:6.1%}" if m.judged else f"{'-':>6}"
        rows.append(f"{name:32} {m.judged:7d} {killed:6d} {len(m.alive):5d} {score} {known:9d}")
    for name, m in sorted(modules.items()):
        left = [a for a in m.alive if a.split(": ")[0] not in equivalent]
        if left:
            rows += ["", f"alive in {name}, not explained:", *(f"  {a}" for a in left)]
    return "\n".join(rows)


if __name__ == "__main__":
    print(report(tally(sys.stdin), explained(SURVIVORS.read_text(encoding="utf-8"))))
