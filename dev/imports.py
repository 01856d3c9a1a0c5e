"""The package's import arrows between its modules (lazy imports inside functions included), its cycles, and the
arrows that run back up its floors: `python dev/imports.py [--dot]`."""

from __future__ import annotations

import ast
import sys
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tiertrain"
# the package's floors, lowest first: a module imports from its own floor and those below it; an arrow to a higher
# floor runs back up. The planner is pure and below the runtime; the tiers know slabs, nothing of plans or models
FLOORS = [
    (
        "names",
        [
            "tiertrain",
            "tiertrain.errors",
            "tiertrain.sizes",
            "tiertrain.modes",
            "tiertrain.paths",
            "tiertrain.signals",
            "tiertrain.model.ropes",
            "tiertrain.model.spec",
            "tiertrain.sections",
            "tiertrain.config",
        ],
    ),
    ("tiers", ["tiertrain.tiers.*"]),
    ("plan", ["tiertrain.plan.*", "tiertrain.model.parts"]),  # parts: the sizes of a block in parts, pure
    (
        "runtime",
        [
            "tiertrain.model.*",
            "tiertrain.engine.*",
            "tiertrain.optim.*",
            "tiertrain.parallel",
            "tiertrain.state",
            "tiertrain.data",
            "tiertrain.tokenfile",
            "tiertrain.prepare",
            "tiertrain.chat",
            "tiertrain.rows",
            "tiertrain.checkpoint",
            "tiertrain.checkpoint_load",
            "tiertrain.checksum",
            "tiertrain.durable",
            "tiertrain.metrics",
            "tiertrain.probe",
            "tiertrain.charts",
            "tiertrain.launch",
            "tiertrain.rundir",
            "tiertrain.runclaim",
            "tiertrain.export",
        ],
    ),
    (
        "run",
        ["tiertrain.assemble", "tiertrain.trainer", "tiertrain.records", "tiertrain.loop", "tiertrain.start"],
    ),
    (
        "cli",
        [
            "tiertrain.cli",
            "tiertrain.cli_types",
            "tiertrain.cli_prepare",
            "tiertrain.plancmd",
            "tiertrain.__main__",
        ],
    ),
]


def floor(m: str) -> int:
    """The index of the module's floor (the first that names it)."""
    for i, (_, patterns) in enumerate(FLOORS):
        if any(fnmatch(m, p) for p in patterns):
            return i
    raise KeyError(f"{m} is on no floor: add it to dev/imports.py's FLOORS")


def upward(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The arrows that run back up: from a module to one on a higher floor."""
    return sorted((m, t) for m, ts in g.items() for t in ts if floor(t) > floor(m))


def module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def arrows() -> dict[str, set[str]]:
    """{module: the package's modules it imports}."""
    mods = {module(p): p for p in ROOT.rglob("*.py")}
    out: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                names = [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                target, names = "", [a.name for a in node.names]
            else:
                continue
            for t in names + [target]:
                if t in mods and t != m:
                    out[m].add(t)
                    break
    for m in out:  # an empty package __init__ is no room
        out[m] = {t for t in out[m] if mods[t].stat().st_size or t == m}
    return {m: v for m, v in out.items() if mods[m].stat().st_size}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    g = arrows()
    up = upward(g)
    print(
        f"{len(g)} modules, {sum(map(len, g.values()))} arrows, {len(cycles(g))} cycles, {len(up)} arrows back up"
    )
    for c in cycles(g):
        print("cycle:", " <-> ".join(c))
    for m, t in up:
        print(f"back up: {m} -> {t}")
    if "--dot" in sys.argv:
        for m in sorted(g):
            for t in sorted(g[m]):
                print(f"  {m} -> {t}")
