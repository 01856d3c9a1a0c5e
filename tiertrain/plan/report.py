"""The capacity report: markdown for people, JSON for tools. Pure Python."""

from __future__ import annotations

import json
import math

from ..config import position_lift
from ..modes import Home, Update, by_value
from ..sizes import budget, gb, num
from .advice import LARGEST_LAYERS
from .values import Miss, Plan, Report

# the prediction's links (Prediction.times' keys, kept in the JSON) in a user's words
LINKS = {
    "compute fwd": "GPU compute, forward pass",
    "compute bwd": "GPU compute, backward pass (recompute included)",
    "H2D fwd": "copies to the GPU, forward pass",
    "D2H fwd": "copies from the GPU, forward pass",
    "PCIe both fwd": "copies both ways at once, forward pass",
    "H2D bwd": "copies to the GPU, backward pass",
    "D2H": "gradients from the GPU, backward pass",
    "PCIe both bwd": "copies both ways at once, backward pass",
    "peer fwd": "GPU-to-GPU all-gathers, forward pass",
    "peer bwd": "GPU-to-GPU all-gathers and reduce-scatters, backward pass",
    "NVMe read": "NVMe reads beside the forward pass",
    "NVMe write": "NVMe writes beside the forward pass",
    "NVMe": "NVMe reads and writes beside the forward pass",
    "NVMe bwd": "NVMe reads and writes, backward pass",
    "NVMe checkpoints fwd": "activation checkpoints written to NVMe, forward pass",
    "host AdamW": "host AdamW after the gradient norm",
    "host AdamW bwd": "host AdamW speculated in the backward pass",
    "host DRAM fwd": "host memory bandwidth, forward pass and update",
    "host DRAM bwd": "host memory bandwidth, backward pass",
    "exposed update": "update not hidden by the forward pass",
}
# the state's kinds (their JSON names) in a user's words
KINDS = {
    "weights": "bf16 weights (the copy that streams)",
    "master": "fp32 master weights",
    "exp_avg": "Adam first moment",
    "exp_avg_sq": "Adam second moment",
    "grad": "fp32 gradients",
}
BUDGETS = {"GPU": "GPU memory (usable part)", "host": "host memory (--host-gb)", "NVMe": "NVMe (--nvme-gb)"}


def _gb(n: float) -> str:
    """A size in the tables: GB with one decimal, a small one (a small model's) in MiB or KiB, never 0.0 GB."""
    return f"{n / 1e9:,.1f} GB" if n == 0 or abs(n) >= 1e9 else gb(n)


def _params(n: float) -> str:
    """A parameter count: billions with two decimals, a small model's in millions or thousands."""
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n / 1e3:.2f} K"


def tier_bars(p: Plan) -> dict[str, dict[str, float]]:
    """Each tier's bytes by part, in a user's words (the chart's bars): the state's kinds, the host's other bytes,
    the activation checkpoints on NVMe beside the state there, the GPU's parts."""
    mem = p.memory
    fixed = {"the process itself" if k == "process" else k: v for k, v in mem.host_fixed().items()}
    return {
        "host": {**{KINDS.get(k.value, k.value): b for k, b in mem.host.items()}, **fixed},
        "NVMe": {
            **{KINDS.get(k.value, k.value): b for k, b in mem.nvme.items()},
            **({"activation checkpoints": mem.nvme_checkpoints} if mem.nvme_checkpoints else {}),
        },
        "GPU": mem.gpu.table(),
    }


def links(p: Plan) -> dict[str, float]:
    """The predicted seconds per link in a user's words, those of GPU-to-GPU links only with several GPUs."""
    several = p.run_plan.gpus > 1
    return {LINKS.get(k, k): v for k, v in p.prediction.times.items() if several or not k.startswith("peer")}


def plan_dict(p: Plan | Miss) -> dict:
    """The plan as one flat table, the keys of `tiertrain plan --format json` and <out>/plan.json: its choices,
    memory and prediction, what a report adds, and its RunPlan's units (as RunPlan.to_dict writes them)."""
    rp, mem, fits = p.run_plan, p.memory, p.fits
    pr = p.prediction if fits else None
    rep = p.report if fits else Report()
    return {
        "model": p.job.name,
        "params": p.job.spec.n_params,
        "active_params": p.job.spec.n_active_params,  # of a mixture of experts: those a token uses
        "batch": p.job.batch,
        "seq_len": p.job.seq_len,
        "dtype": rp.compute_dtype,
        "micro_batch": rp.micro_batch,
        "stream": rp.stream,
        "activations": rp.activations,
        "gpu_updates": rp.count(Update.GPU, Update.GPU_SPECULATED),
        "resident_gb": rp.resident_gb,
        "kept": mem.kept,
        "kept_checkpoints": mem.kept_checkpoints,
        "kept_attention": mem.kept_attention,
        "checkpoints": {h.value: n for h, n in mem.checkpoints.items()},
        "tile": rp.tile,
        "expert_groups": rp.expert_groups,
        "spill_first": rp.spill_first,
        "attention": rp.attention,
        "deterministic": rp.deterministic,
        "activation_dtype": rp.activation_dtype,
        "nvme_ahead": mem.nvme_ahead,
        "speculated": rp.count(Update.HOST_SPECULATED),
        "gpu_speculated": bool(rp.count(Update.GPU_SPECULATED)),
        "clipping": p.job.clipping if fits else True,
        "fits": fits,
        "why": p.why,
        "short_of": "" if fits else p.short.value,
        "host_total_bytes": mem.host_total,
        "gpu_total_bytes": mem.gpu.total,
        "host_bytes": {k.value: b for k, b in mem.host.items()},
        "nvme_bytes": {k.value: b for k, b in mem.nvme.items()},
        "nvme_bwd_reads": mem.nvme_bwd_reads,
        "nvme_checkpoints": mem.nvme_checkpoints,
        "least_host": p.least_host,
        "placement": {k.value: {h.value: n for h, n in v.items()} for k, v in mem.placement.items()},
        "host_fixed": mem.host_fixed(),
        "gpu": mem.gpu.table(),
        "times": dict(pr.times) if pr else {},
        "step_s": pr.step_s if pr else math.inf,
        "clipped_times": dict(pr.clipped_times) if pr else {},
        "clipped_step_s": pr.clipped_step_s if pr else math.inf,
        "bottleneck": pr.bottleneck if pr else "",
        "tokens_per_s": pr.tokens_per_s if pr else 0.0,
        "model_tflops": pr.model_tflops if pr else 0.0,
        "advice": list(rep.advice),
        "largest_layers": rep.largest_layers,
        "largest_params": rep.largest_params,
        "longest_seq_len": rep.longest_seq_len,
        "longest_bound": rep.longest_bound,
        "longest_budgets_seq_len": rep.longest_budgets,
        "hardware": p.hardware,
        "gpus": rp.gpus,
        "gpus_per_host": p.per_host,
        "units": [u.to_dict() for u in rp.units],
        **({} if fits else _missed(p)),
    }


def _missed(p: Miss) -> dict:
    """A miss's keys: the short budget's bytes needed and held, every budget's, and the nearest plans that fit."""
    return {
        "need_bytes": p.need,
        "budget_bytes": p.have,
        "demand": {k: {"need_bytes": n, "budget_bytes": h} for k, (n, h) in p.demand.items()},
        "nearest": [
            {"args": list(n.args), "what": n.what, "step_s": n.step_s, "tokens_per_s": n.tokens_per_s}
            for n in p.nearest
        ],
    }


def to_json(p: Plan | Miss, one: Plan | Miss | None = None, chart: str | None = None) -> str:
    """`tiertrain plan --format json`: plan_dict, with several GPUs the scaling against `one`, and the
    path of the chart drawn (`chart`)."""
    d = plan_dict(p)
    if chart:
        d["chart"] = str(chart)
    if one is not None and p.run_plan.gpus > 1:
        d["scaling"] = {
            "one_gpu_tokens_per_s": one.prediction.tokens_per_s if one.fits else 0.0,
            "speedup": _speedup(p, one),
            "bound": _bound(p),
        }
    return json.dumps(d, indent=1, default=float)


def _checkpoints(p: Plan) -> str:
    """Where the activation checkpoints live, and the MLP's tiles."""
    where = {Home.GPU: "the GPU", Home.HOST: "the host", Home.NVME: "NVMe"}
    homes = [(where[h], n) for h, n in p.memory.checkpoints.items() if n]
    text = (
        (
            "activation checkpoints on " + homes[0][0]
            if len(homes) == 1
            else "activation checkpoints split: " + ", ".join(f"{n} on {h}" for h, n in homes)
        )
        if homes
        else "no activation checkpoints"
    )
    rp = p.run_plan
    kernel = rp.attention or "torch's choice"
    tiles = f"; blocks in tiles of {rp.tile:,} tokens" if rp.tile else ""
    if rp.expert_groups > 1:  # model/parts.py
        tiles += f"; each block's experts in {rp.expert_groups} groups, streamed after its attention part"
    return text + tiles + f"; attention: {kernel}" + " (deterministic)" * rp.deterministic


def _speedup(p: Plan | Miss, one: Plan | Miss) -> float:
    return p.prediction.tokens_per_s / one.prediction.tokens_per_s if one.fits and p.fits else 0.0


def _bound(p: Plan | Miss) -> str:
    """What keeps N GPUs from N times one GPU's rate: the links and the host that every rank shares."""
    shared = {
        "host AdamW": "the host AdamW (the host's cores are shared by its ranks)",
        "host DRAM": "the host's DRAM bandwidth (shared by its ranks)",
        "NVMe": "the disk (shared by the host's ranks)",
        "GPU links": "the all-gathers and reduce-scatters between the GPUs",
    }
    neck = p.prediction.bottleneck if p.fits else ""
    return shared.get(neck, f"{neck}, each GPU's own")


def _ranks(p: Plan, one: Plan | Miss | None) -> list[str]:
    """What N GPUs do: each rank's share, the scaling against one GPU at the same batch, and what bounds it."""
    gpus = p.run_plan.gpus
    if gpus == 1:
        return []
    head = (
        f"**{gpus} GPUs**, {p.per_host} per host: each rank takes {p.job.rows} of the batch's {p.job.batch} "
        f"rows, holds and updates 1/{gpus} of every slab (the tables below are one rank's; --host-gb is the "
        f"host's); the weights cross each GPU's PCIe link as shards and are all-gathered, the gradients "
        f"reduce-scattered."
    )
    if one is None or not one.fits:
        return [head, ""]
    return [
        head
        + f" Scaling: {_speedup(p, one):.2f}x one GPU ({one.prediction.tokens_per_s:,.0f} tokens/s at this "
        f"batch), bound by {_bound(p)}.",
        "",
    ]


def _active(spec) -> str:
    """A mixture of experts' active parameters, on which its FLOPs and model TFLOP/s are counted."""
    return f" ({_params(spec.n_active_params)} active)" if spec.is_moe else ""


def to_markdown(p: Plan | Miss, one: Plan | Miss | None = None) -> str:
    """`one`: the plan of one GPU at the same batch, for a plan of several (the scaling)."""
    rp, job = p.run_plan, p.job
    out = [
        f"# Plan: {job.name}, {_params(job.spec.n_params)} parameters{_active(job.spec)}, "
        f"batch {job.batch} x {job.seq_len} "
        f"tokens, {rp.compute_dtype}",
        "",
        f"hardware: {p.hardware}",
        "",
    ]
    if not p.fits:
        return "\n".join(out + miss_markdown(p))
    pr, mem = p.prediction, p.memory
    out += _ranks(p, one)
    out += [
        f"**Fits.** Predicted step {num(pr.step_s)} s: {num(pr.tokens_per_s)} tokens/s, "
        f"{num(pr.model_tflops)} model TFLOP/s; bottleneck: **{pr.bottleneck}**.",
        "",
        f"Micro-batch {rp.micro_batch}; "
        + (
            f"{rp.resident_gb:g} GB of GPU memory holds the whole state of the first units; "
            if rp.resident_gb
            else ""
        )
        + "weights stream as "
        f"{'a host bf16 copy' if rp.stream == 'compute' else 'fp32 master, cast on the GPU'}; "
        + _checkpoints(p)
        + (
            f" ({mem.kept} last blocks keep their activations on the GPU instead: no recompute)"
            if mem.kept
            else ""
        )
        + (
            f" ({mem.kept_attention} blocks keep their attention outputs on the GPU: their recompute runs no "
            "attention); "
            if mem.kept_attention
            else "; "
        )
        + _updates(p),
        "",
    ]
    out += _memory(p) + _times(p) + _findings(p)
    return "\n".join(out)


def _memory(p: Plan) -> list[str]:
    """The memory per tier: the state's kinds on the host and NVMe, the host's other bytes, the GPU's parts."""
    mem = p.memory
    out = ["## Memory per tier", "", "| kind | host | NVMe | units on NVMe |", "| --- | --- | --- | --- |"]
    for k in by_value(mem.placement):
        on = mem.placement[k]
        out.append(
            f"| {KINDS.get(k.value, k.value)} | {_gb(mem.host.get(k, 0))} | {_gb(mem.nvme.get(k, 0))} | "
            f"{on[Home.NVME]} of {on[Home.HOST] + on[Home.NVME]} |"
        )
    for k, v in mem.host_fixed().items():
        out.append(
            f"| {'the process itself (Python, torch, the CUDA context)' if k == 'process' else k} | {_gb(v)} | | |"
        )
    if mem.nvme_checkpoints:
        out.append(
            f"| activation checkpoints on NVMe | | {_gb(mem.nvme_checkpoints)} | {mem.checkpoints[Home.NVME]} of "
            f"{sum(mem.checkpoints.values())} |"
        )
    out += [
        f"| **total** | **{_gb(mem.host_total)}** | **{_gb(sum(mem.nvme.values()) + mem.nvme_checkpoints)}** "
        "| |",
        "",
        (
            "Spill order when the host budget is short: Adam moments (touched once per step, by the "
            "optimizer only), then the fp32 master when a bf16 copy is what streams (then it too is the "
            "optimizer's only), then gradients (written during the backward pass), and last the weights "
            "that stream (read twice a step)"
            if p.run_plan.spill_first == "moments"
            else "Spill order: gradients first (tiers.spill_first: written in the backward pass and read once after "
            "the norm, where spilled moments would be read and written beside the next forward pass), then the "
            "Adam moments, then the fp32 master when a bf16 copy is what streams, and last the weights that stream"
        )
        + "; a unit whose ring buffers would cost more than its slabs "
        "stays in RAM. Host slabs take whole pages. --host-gb is the process's whole host memory: the process's "
        f"own {_gb(mem.process)} counts in it."
        + (
            f" With this NVMe tier the least --host-gb for this choice is {budget(p.least_host)}."
            if p.least_host
            else ""
        ),
        "",
        "| GPU | bytes |",
        "| --- | --- |",
    ]
    gpu = mem.gpu.table()
    return (
        out
        + [f"| {k} | {_gb(v)} |" for k, v in gpu.items()]
        + [f"| **total** | **{_gb(mem.gpu.total)}** |", ""]
    )


def _times(p: Plan) -> list[str]:
    out = ["## Time per step (predicted)", "", "| what | seconds |", "| --- | --- |"]
    out += [f"| {k} | {num(v)} |" for k, v in links(p).items()]
    return out + [
        "",
        "step = backward + max(forward, update): the update needs the global gradient norm, so it "
        "overlaps only the next forward pass (or, speculated, the backward pass).",
        "",
    ]


def _findings(p: Plan) -> list[str]:
    """What the report adds: advice, the largest model, the longest sequence."""
    rep, out = p.report, []
    if rep.advice:
        out += ["## What would help most", ""] + [f"- {a}" for a in rep.advice] + [""]
    if rep.largest_layers:
        most = "at least " if rep.largest_layers >= LARGEST_LAYERS else ""  # the search stops there
        out += [
            f"Largest model of this shape that fits these budgets: {most}{rep.largest_layers} layers, "
            f"{_params(rep.largest_params)} parameters.",
            "",
        ]
    if rep.longest_seq_len:
        out += [_longest(p), ""]
    return out


def _longest(p: Plan) -> str:
    """The longest sequence, what bounds it, and past the model's positions what lifts them."""
    rep = p.report
    head = (
        f"Longest sequence ({'batch 1' if p.run_plan.gpus == 1 else 'one per GPU'}) that fits these budgets: "
    )
    if rep.longest_bound == "positions":
        return (
            head
            + f"{rep.longest_seq_len:,} tokens, bound by the model's positions (model.max_position_embeddings; "
            f"the budgets hold {rep.longest_budgets:,}). A rope scaling lifts it: "
            f"`{position_lift(p.job.spec, rep.longest_budgets)}`."
        )
    names = {"GPU": "GPU memory", "host": "host RAM", "NVMe": "the NVMe budget"}
    bound = " and ".join(names[b] for b in rep.longest_bound.split(", ") if b in names)
    return head + (
        f"{rep.longest_seq_len:,} tokens, bound by {bound}."
        if bound
        else f"at least {rep.longest_seq_len:,} tokens."
    )


def miss_markdown(p: Miss) -> list[str]:
    """A miss as a consultant answers it: the budget that falls short and by how much, each budget's demand, and
    the nearest plans that fit on the same machine, each with its predicted step."""
    out = [f"**Does not fit.** {p.why}", ""]
    if p.need > p.have:
        short = next((k for k, (n, h) in p.demand.items() if (n, h) == (p.need, p.have)), "")
        out += [
            f"Short of {BUDGETS.get(short, short)} by **{gb(p.need - p.have)}**: the plan needs {gb(p.need)}, "
            f"the budget holds {gb(p.have)}.",
            "",
        ]
    if p.demand:
        out += ["| budget | needed (as far as the plan got) | held |", "| --- | --- | --- |"]
        out += [
            f"| {v} | {_gb(p.demand[k][0])} | {_gb(p.demand[k][1])} |"
            for k, v in BUDGETS.items()
            if k in p.demand
        ]
        out += [""]
    if not p.nearest:
        return out + [
            "No plan near this one fits these budgets (a smaller batch, sequence or micro-batch, checkpoints or "
            "state on NVMe, bf16 checkpoints): raise the budget that falls short.",
            "",
        ]
    out += [
        "## Nearest plans that fit on this machine",
        "",
        "Each row's arguments, added to the same `tiertrain plan` command, make a plan that fits; `tiertrain run` "
        "takes them too (an NVMe tier with --nvme-dir DIR).",
        "",
        "| arguments | what changes | predicted step | tokens/s |",
        "| --- | --- | --- | --- |",
    ]
    out += [
        f"| `{' '.join(n.args)}` | {n.what} | {num(n.step_s)} s | {num(n.tokens_per_s)} |" for n in p.nearest
    ]
    return out + [""]


def _updates(p: Plan) -> str:
    """Where and when the units are updated: on the GPU, on the host, speculated in the backward pass."""
    rp = p.run_plan
    n_gpu, speculated = rp.count(Update.GPU, Update.GPU_SPECULATED), rp.count(Update.HOST_SPECULATED)
    gpu_speculated = bool(rp.count(Update.GPU_SPECULATED))
    s = "s" * (n_gpu != 1)
    gpu = (
        f"{n_gpu} streamed unit{s} updated on the GPU "
        + (
            "in the backward pass, as their gradients are accumulated (speculated)"
            if gpu_speculated
            else f"as {'they load' if s else 'it loads'}"
        )
        + ", the rest by the host AdamW."
        if n_gpu
        else "the host AdamW updates every streamed unit."
    )
    if not (speculated or gpu_speculated):
        return gpu
    how = (
        "kept when the global norm does not clip, redone when it does; the times below are those of a step "
        f"that does not clip (while the norm clips, as early in training, nothing speculates: "
        f"{num(p.prediction.clipped_step_s)} s a step)"
        if p.job.clipping
        else "in place: clipping is off, so there is nothing to undo"
    )
    host = (
        f" {speculated} of the units the host updates (every other one from the last first) start"
        f"{'s' * (speculated == 1)} their update in the backward pass, as their gradients land."
        if speculated
        else ""
    )
    return f"{gpu}{host} Speculated updates: {how}."
