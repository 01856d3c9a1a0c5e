"""The package's shape: no import cycles between its modules, no arrow back up its floors (dev/imports.py: the tiers
below the planner, the planner pure and below the runtime, assemble and the trainer above), the planner importing no
torch, and every module small."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what the planner may import: itself, the model's shape, the shared names, and the tiers' pure layout and policy
BELOW_PLAN = {
    "tiertrain.model.spec",
    "tiertrain.model.ropes",
    "tiertrain.model.parts",
    "tiertrain.modes",
    "tiertrain.paths",
    "tiertrain.sizes",
    "tiertrain.errors",
    "tiertrain.config",
    "tiertrain.sections",
    "tiertrain.tiers.placement",
    "tiertrain.tiers.slab",
}


def _graph():
    spec = importlib.util.spec_from_file_location("imports", ROOT / "dev" / "imports.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, mod.arrows()


def test_no_import_cycles():
    mod, g = _graph()
    assert mod.cycles(g) == []
    # the check itself: a cycle is found where there is one
    assert mod.cycles({**g, "tiertrain.modes": {"tiertrain.plan.values"}})


def test_no_arrow_runs_back_up():
    """Every module imports from its floor and those below; nothing below the planner imports it (the tiers take
    sizes and homes, never a RunPlan), and every module is on a floor."""
    mod, g = _graph()
    assert mod.upward(g) == []
    below = {m for m in g if mod.floor(m) < mod.floor("tiertrain.plan.runplan")}
    assert below and not any(t.startswith("tiertrain.plan") for m in below for t in g[m])
    # the check itself: an arrow from the tiers to the plan runs back up
    assert mod.upward({**g, "tiertrain.tiers.host": {"tiertrain.plan.runplan"}})


def test_the_planner_imports_only_what_is_below_it():
    _, g = _graph()
    seen, todo = set(), [m for m in g if m.startswith("tiertrain.plan.")]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += g.get(m, ())
    assert {m for m in seen if not m.startswith("tiertrain.plan.")} <= BELOW_PLAN


def test_the_planner_imports_no_torch():
    """Every module of tiertrain.plan, and `tiertrain plan` itself, load without torch or numpy."""
    mods = sorted(p.stem for p in (ROOT / "tiertrain" / "plan").glob("*.py") if p.stem != "__init__")
    code = (
        "import sys, importlib; import tiertrain.plan; "
        f"[importlib.import_module('tiertrain.plan.' + m) for m in {mods}]; "
        "bad = [m for m in ('torch', 'numpy') if m in sys.modules]; assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert len(mods) >= 8


def test_modules_stay_small():
    """About 400 lines at most (the guide's), with a margin for the largest."""
    sizes = {p: len(p.read_text().splitlines()) for p in (ROOT / "tiertrain").rglob("*.py")}
    assert max(sizes.values()) <= 480, max(sizes, key=sizes.get)
