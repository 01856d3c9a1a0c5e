"""The capacity report: markdown for people, JSON for tools. Pure Python."""
from __future__ import annotations

import copy
import json
from dataclasses import fields

from ..sizes import budget
from .advice import LARGEST_LAYERS
from .values import Plan

# the RunPlan's fields among the plan's own, in the order of the JSON (`tiertrain plan --format json`, plan.json)
AFTER = {"seq_len": ("dtype", "micro_batch", "stream", "activations"), "gpu_updates": ("resident_gb",),
         "checkpoints": ("tile", "checkpoint_dtype"), "hardware": ("gpus",), "gpus_per_host": ("units",)}


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def plan_dict(p: Plan) -> dict:
    """The plan as one flat table: its own values and its RunPlan's (units as RunPlan.to_dict writes them)."""
    rp = p.run_plan.to_dict() | {"dtype": p.run_plan.compute_dtype}
    out = {}
    for f in fields(p):
        if f.name != "run_plan":
            out[f.name] = copy.deepcopy(getattr(p, f.name))
            out.update((k, rp[k]) for k in AFTER.get(f.name, ()))
    return out


def to_json(p: Plan, one: Plan | None = None) -> str:
    d = plan_dict(p)
    d.update(host_total_bytes=p.host_total, gpu_total_bytes=p.gpu_total)
    if one is not None and p.run_plan.gpus > 1:
        d["scaling"] = {"one_gpu_tokens_per_s": one.tokens_per_s, "speedup": _speedup(p, one), "bound": _bound(p)}
    return json.dumps(d, indent=1, default=float)


def _checkpoints(p: Plan) -> str:
    """Where the activation checkpoints live, and the MLP's tiles."""
    where = {"gpu": "the GPU", "host": "the host", "nvme": "NVMe"}
    homes = [(where[h], n) for h, n in p.checkpoints.items() if n]
    text = ("activation checkpoints on " + homes[0][0] if len(homes) == 1 else
            "activation checkpoints split: " + ", ".join(f"{n} on {h}" for h, n in homes)) if homes else \
        "no activation checkpoints"
    tile = p.run_plan.tile
    return text + (f"; blocks in tiles of {tile:,} tokens" if tile else "")


def _speedup(p: Plan, one: Plan) -> float:
    return p.tokens_per_s / one.tokens_per_s if one.fits and p.fits else 0.0


def _bound(p: Plan) -> str:
    """What keeps N GPUs from N times one GPU's rate: the links and the host that every rank shares."""
    shared = {"host AdamW": "the host AdamW (the host's cores are shared by its ranks)",
              "host DRAM": "the host's DRAM bandwidth (shared by its ranks)",
              "NVMe": "the disk (shared by the host's ranks)",
              "GPU links": "the all-gathers and reduce-scatters between the GPUs"}
    return shared.get(p.bottleneck, f"{p.bottleneck}, each GPU's own")


def _ranks(p: Plan, one: Plan | None) -> list[str]:
    """What N GPUs do: each rank's share, the scaling against one GPU at the same batch, and what bounds it."""
    gpus = p.run_plan.gpus
    if gpus == 1:
        return []
    head = (f"**{gpus} GPUs**, {p.gpus_per_host} per host: each rank takes {p.rows} of the batch's {p.batch} rows, "
            f"holds and updates 1/{gpus} of every slab (the tables below are one rank's; --host-gb is the "
            f"host's); the weights cross each GPU's PCIe link as shards and are all-gathered, the gradients "
            f"reduce-scattered.")
    if one is None or not one.fits:
        return [head, ""]
    return [head + f" Scaling: {_speedup(p, one):.2f}x one GPU ({one.tokens_per_s:,.0f} tokens/s at this batch), "
            f"bound by {_bound(p)}.", ""]


def to_markdown(p: Plan, one: Plan | None = None) -> str:
    """`one`: the plan of one GPU at the same batch, for a plan of several (the scaling)."""
    rp = p.run_plan
    out = [f"# Plan: {p.model}, {p.params / 1e9:.2f} B parameters, batch {p.batch} x {p.seq_len} tokens, "
           f"{rp.compute_dtype}",
           "", f"hardware: {p.hardware}", ""]
    if not p.fits:
        return "\n".join(out + [f"**Does not fit.** {p.why}", ""])
    out += _ranks(p, one)
    out += [f"**Fits.** Predicted step {p.step_s:.2f} s: {p.tokens_per_s:,.0f} tokens/s, "
            f"{p.model_tflops:.0f} model TFLOP/s; bottleneck: **{p.bottleneck}**.", "",
            f"Micro-batch {rp.micro_batch}; "
            + (f"{rp.resident_gb:g} GB of GPU memory holds the whole state of the first units; " if rp.resident_gb
               else "")
            + "weights stream as "
            f"{'a host bf16 copy' if rp.stream == 'compute' else 'fp32 master, cast on the GPU'}; "
            + _checkpoints(p)
            + (f" ({p.kept} last blocks keep their activations on the GPU instead: no recompute); " if p.kept else "; ")
            + _updates(p), "",
            "## Memory per tier", "", "| kind | host | NVMe | units on NVMe |", "| --- | --- | --- | --- |"]
    for k in sorted(p.placement):
        out.append(f"| {k} | {_gb(p.host_bytes.get(k, 0))} | {_gb(p.nvme_bytes.get(k, 0))} | "
                   f"{p.placement[k]['nvme']} of {p.placement[k]['host'] + p.placement[k]['nvme']} |")
    for k, v in p.host_fixed.items():
        out.append(f"| {k}{' (not in --host-gb)' if k == 'process' else ''} | {_gb(v)} | | |")
    if p.nvme_checkpoints:
        out.append(f"| activation checkpoints on NVMe | | {_gb(p.nvme_checkpoints)} | {p.checkpoints['nvme']} of "
                   f"{sum(p.checkpoints.values())} |")
    out += [f"| **total** | **{_gb(p.host_total)}** | **{_gb(sum(p.nvme_bytes.values()) + p.nvme_checkpoints)}** | |", "",
            "Spill order when the host budget is short: Adam moments (touched once per step, by the "
            "optimizer only), then the fp32 master when a bf16 copy is what streams (then it too is the "
            "optimizer's only), then gradients (written during the backward pass), and last the weights "
            "that stream (read twice a step); a unit whose ring buffers would cost more than its slabs "
            "stays in RAM. Host slabs take whole pages."
            + (f" With this NVMe tier the least --host-gb for this choice is {budget(p.least_host)}."
               if p.least_host else ""), "",
            "| GPU | bytes |", "| --- | --- |"]
    out += [f"| {k} | {_gb(v)} |" for k, v in p.gpu.items()] + [f"| **total** | **{_gb(p.gpu_total)}** |", ""]
    out += ["## Time per step (predicted)", "", "| link | seconds |", "| --- | --- |"]
    out += [f"| {k} | {v:.3f} |" for k, v in p.times.items()]
    out += ["", "step = backward + max(forward, update): the update needs the global gradient norm, so it "
            "overlaps only the next forward pass (or, speculated, the backward pass).", ""]
    if p.advice:
        out += ["## What would help most", ""] + [f"- {a}" for a in p.advice] + [""]
    if p.largest_layers:
        most = "at least " if p.largest_layers >= LARGEST_LAYERS else ""  # the search stops there
        out += [f"Largest model of this shape that fits these budgets: {most}{p.largest_layers} layers, "
                f"{p.largest_params / 1e9:.1f} B parameters.", ""]
    if p.longest_seq_len:
        names = {"GPU": "GPU memory", "host": "host RAM", "NVMe": "the NVMe budget"}
        bound = " and ".join(names[b] for b in p.longest_bound.split(", ") if b in names)
        out += [f"Longest sequence ({'batch 1' if rp.gpus == 1 else 'one per GPU'}) that fits these budgets: "
                + (f"{p.longest_seq_len:,} tokens, bound by {bound}." if bound else
                   f"at least {p.longest_seq_len:,} tokens."), ""]
    return "\n".join(out)


def _updates(p: Plan) -> str:
    """Where and when the units are updated: on the GPU, on the host, speculated in the backward pass."""
    s = "s" * (p.gpu_updates != 1)
    gpu = (f"{p.gpu_updates} streamed unit{s} updated on the GPU "
           + ("in the backward pass, as their gradients are accumulated (speculated)"
              if p.gpu_speculated else f"as {'they load' if s else 'it loads'}") + ", the rest by the host AdamW."
           if p.gpu_updates else "the host AdamW updates every streamed unit.")
    if not (p.speculated or p.gpu_speculated):
        return gpu
    how = ("kept when the global norm does not clip, redone when it does; the times below are those of a step "
           f"that does not clip (while the norm clips, as early in training, nothing speculates: "
           f"{p.clipped_step_s:.2f} s a step)" if p.clipping else "in place: clipping is off, so there is nothing to undo")
    host = (f" {p.speculated} of the units the host updates (every other one from the last first) start"
            f"{'s' * (p.speculated == 1)} their update in the backward pass, as their gradients land."
            if p.speculated else "")
    return f"{gpu}{host} Speculated updates: {how}."
