"""PNG charts (matplotlib, the optional `chart` extra): a plan's time split and memory per tier, and a
run's loss, tokens/s and measured time split. Imports no torch: `tiertrain plan --chart` runs anywhere."""

from __future__ import annotations

from pathlib import Path

from .errors import UserError, why

# a run's measured time split (metrics.jsonl keys); what is left of the step is launch and host overhead
SPLIT = ("forward_s", "backward_s", "h2d_wait_s", "d2h_wait_s", "opt_wait_s")


FORMATS = (".png", ".svg", ".pdf")  # what matplotlib saves, by the name's suffix


def check_target(flag: str, path: str | Path) -> Path:
    """Where a chart goes, checked before anything is planned or read: an image's name in an existing directory."""
    p = Path(path)
    if p.suffix.lower() not in FORMATS or p.is_dir():
        raise UserError(f"{flag} {path}: a chart is an image file; name a {', '.join(FORMATS)} file")
    if not p.absolute().parent.is_dir():
        raise UserError(
            f"{flag} {path}: the directory {p.absolute().parent} does not exist; create it or pass a file in an "
            "existing directory"
        )
    return p


def _save(fig, path: str | Path) -> None:
    try:
        fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends outside the axes included
    except OSError as e:
        raise UserError(f"cannot write the chart {path}: {why(e)}; pass a writable path") from None


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError(
            "charts need matplotlib: pip install 'tiertrain[chart]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plan_chart(p, path: str | Path) -> None:
    """A plan that fits: left, predicted seconds per link, the step and its bottleneck; right, GB per tier, by
    kind. A plan that does not: each budget's demand against it (miss_chart)."""
    from .plan.report import links, tier_bars
    from .sizes import num

    if not p.fits:
        return miss_chart(p, path)
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 4.8))
    pr = p.prediction
    times = links(p)
    a.barh(list(times), list(times.values()), color="tab:blue")
    a.axvline(pr.step_s, color="tab:red", linestyle="--", label=f"step {num(pr.step_s)} s")
    a.invert_yaxis()
    a.set_xlabel("seconds per step")
    a.set_title(f"{p.job.name}: predicted time (bottleneck: {pr.bottleneck})")
    a.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12))  # below the axes: never over a bar
    tiers = tier_bars(p)
    kinds = sorted({k for parts in tiers.values() for k in parts})
    cmap = plt.get_cmap("tab20")
    left = [0.0] * len(tiers)
    for i, k in enumerate(kinds):
        vals = [tiers[t].get(k, 0) / 1e9 for t in tiers]
        b.barh(list(tiers), vals, left=left, label=k, color=cmap(i % 20))
        left = [x + v for x, v in zip(left, vals)]
    b.invert_yaxis()
    b.set_xlabel("GB")
    b.set_title("memory per tier")
    b.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: never over a bar
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def miss_chart(p, path: str | Path) -> None:
    """A plan that does not fit: each budget's demand (as far as the plan got) against the budget, the short one
    in red, with the shortfall written beside it."""
    from .plan.report import BUDGETS
    from .sizes import gb

    plt = _pyplot()
    names = [k for k in BUDGETS if k in p.demand]
    need = [p.demand[k][0] / 1e9 for k in names]
    have = [p.demand[k][1] / 1e9 for k in names]
    fig, a = plt.subplots(figsize=(9, 1.2 + 0.8 * len(names)))
    labels = [BUDGETS[k] for k in names]
    colors = ["tab:red" if n > h else "tab:green" for n, h in zip(need, have)]
    a.barh(labels, need, color=colors, label="needed (as far as the plan got)")
    a.scatter(have, labels, marker="|", s=900, color="black", zorder=3, label="budget")
    for y, (n, h) in enumerate(zip(need, have)):
        if n > h:
            a.annotate(f"  {gb((n - h) * 1e9)} short", (max(n, h), y), va="center", color="tab:red")
    a.invert_yaxis()
    a.set_xlabel("GB")
    a.set_xlim(0, max(need + have) * 1.3)
    a.set_title(f"{p.job.name}: does not fit ({p.why.split(':')[0]})")
    a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3 - 0.1 / max(len(names), 1)), ncol=2)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def run_chart(records: list[dict], path: str | Path, title: str) -> None:
    """Loss and tokens/s per step, and the measured time split of each step (stacked)."""
    plt = _pyplot()
    steps = [r["step"] for r in records]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    a.plot(steps, [r["loss"] for r in records], color="tab:blue", label="training")
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if val:
        a.plot(*zip(*val), "o-", color="tab:orange", label="validation")
        a.legend(fontsize=7)
    a.set_xlabel("step")
    a.set_title("loss")
    b.plot(steps, [r["tokens_per_s"] for r in records], color="tab:green")
    b.set_xlabel("step")
    b.set_title("tokens/s")
    bottom = [0.0] * len(records)
    for key in SPLIT:
        if any(key in r for r in records):
            vals = [r.get(key, 0.0) for r in records]
            c.bar(steps, vals, bottom=bottom, label=key[:-2], width=1.0)
            bottom = [x + v for x, v in zip(bottom, vals)]
    rest = [max(0.0, r["step_s"] - s) for r, s in zip(records, bottom)]
    c.bar(steps, rest, bottom=bottom, label="other", width=1.0, color="lightgray")
    if any("pred_step_s" in r for r in records):
        c.plot(steps, [r.get("pred_step_s", float("nan")) for r in records], "k--", label="predicted step")
    c.set_xlabel("step")
    c.set_title("time split (s)")
    c.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
