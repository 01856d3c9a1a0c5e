"""What a run says of itself: each step's metrics.jsonl record (its time split, the bytes it moved on each link,
the peaks, the plan's prediction) and the run's description at its start. Read from a Trainer, never written to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
import torch

from .metrics import human_bytes, human_count
from .model.families import unlike_family
from .modes import Home, Kind
from .sizes import num
from .tiers.placement import spilled_bytes

if TYPE_CHECKING:
    from .assemble import Run
    from .trainer import Trainer


@dataclass(frozen=True)
class Counters:
    """The counts a step's record is measured against, taken before the step."""

    moved: tuple[int, int]  # (H2D, D2H) bytes so far
    ck_disk: int  # activation checkpoints' disk bytes so far
    ck_wait: float  # seconds the step's thread waited on their disk I/O so far
    speculation_kept: bool  # the last update's speculation was kept: this forward pass waited for it


def counters(tr: Trainer) -> Counters:
    """What a step's record measures the step against: the counts so far, the last update's speculation."""
    if tr.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(tr.device)
    acts = tr.run.activations
    return Counters(bytes_moved(tr.run), acts.disk_bytes, acts.wait_s, tr.run.updates.last_kept)


def record(tr: Trainer, before: Counters, loss: float, grad_norm: float, lr: float, dt: float, shape) -> dict:
    """The step's metrics.jsonl record: its own, its time split, the bytes it moved on each link, the peaks,
    and on a GPU the plan's prediction of it."""
    tc, upd, nvme, acts = tr.cfg.train, tr.run.updates, tr.run.nvme, tr.run.activations
    tokens = shape[0] * shape[1] * tr.ranks.size
    tflops = tr.cfg.model.flops_per_token(shape[1]) * tokens / dt / 1e12
    rec = {
        "step": tr.step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tr.step * tokens,
        "step_s": dt,
        "tokens_per_s": tokens / dt,
        "model_tflops": tflops,
    }
    rec.update({f"{k}_s": v for k, v in tr.run.clock.read().items()})
    rec["opt_wait_s"] = upd.host.wait_s
    if upd.any_speculated:  # steps so far whose speculation was kept / redone (clipped)
        rec["speculation_kept"], rec["speculation_redone"] = upd.kept, upd.redone
    now = bytes_moved(tr.run)
    rec["h2d_gb"], rec["d2h_gb"] = (now[0] - before.moved[0]) / 1e9, (now[1] - before.moved[1]) / 1e9
    if nvme:  # NVMe bytes of the last whole update (the previous step's, read ahead and written back)
        rec["nvme_read_gb"], rec["nvme_write_gb"] = (b / 1e9 for b in nvme.traffic.last_pass)
        rec["nvme_io_s"] = nvme.traffic.last_window_s
    if acts.store is not None:  # activation checkpoints written to NVMe and read back this step
        rec["ck_disk_gb"] = (acts.disk_bytes - before.ck_disk) / 1e9
        rec["ck_wait_s"] = acts.wait_s - before.ck_wait  # the step's thread waiting on their disk I/O
        rec["ck_write_gbs"] = acts.write_rate()  # the writes' rate while some were on their way (landed ones)
    if tr.peak_tflops:
        rec["mfu"] = tflops / tr.peak_tflops
    if tr.device.type == "cuda":
        rec["gpu_peak_gb"] = torch.cuda.max_memory_allocated(tr.device) / 1e9
    rec["host_rss_gb"] = psutil.Process().memory_info().rss / 1e9
    if tr.predicts and tuple(shape) == (tc.batch_size // tr.ranks.size, tc.seq_len):
        # its forward pass waited for the last update, speculated beside a backward pass unless a norm clipped
        p = tr.plan.prediction
        pt, ps = (p.times, p.step_s) if before.speculation_kept else (p.clipped_times, p.clipped_step_s)
        rec.update(
            pred_step_s=ps,
            pred_forward_s=pt["compute fwd"],
            pred_backward_s=pt["compute bwd"],
            pred_opt_wait_s=pt["exposed update"],
        )
    return rec


def bytes_moved(r: Run) -> tuple[int, int]:
    """(H2D, D2H) bytes so far: weights, gradients, GPU updates' state and activation checkpoints."""
    ck, gpu = r.activations, r.updates.gpu
    return (
        r.slots.h2d_bytes + gpu.h2d_bytes + ck.h2d_bytes,
        r.grads.d2h_bytes + gpu.d2h_bytes + ck.d2h_bytes,
    )


def _checkpoint_homes(tr: Trainer) -> str:
    """Where the activation checkpoints live, for the run's description; the MLP's tiles."""
    homes = list(tr.run_plan.checkpoints().values())
    where = {Home.GPU: "on the device", Home.HOST: "in pinned host memory", Home.NVME: "on NVMe"}
    text = (
        ", ".join(f"{homes.count(h)} checkpoints {w}" for h, w in where.items() if h in homes)
        or "no checkpoints"
    )
    store = tr.run.activations.store
    return (
        text
        + (f" in {store.root}" if store else "")
        + (f", blocks in tiles of {tr.run_plan.tile:,} tokens" if tr.run_plan.tile else "")
    )


def describe(tr: Trainer) -> list[str]:
    """The run's description, a line a part: ranks, model, batch, tiers, plan, device."""
    spec, tc, pr = tr.cfg.model, tr.cfg.train, tr.plan.prediction
    host, nvme = tr.run.host.nbytes(), tr.run.nvme
    nv = spilled_bytes([sh.numel for sh in tr.shards], tr.run_plan.kind_bytes(), tr.run_plan.where())
    # a GPU run whose plan puts state or checkpoints on a disk no probe measured says how to measure it
    on_disk = sum(tr.plan.memory.nvme.values()) or tr.plan.memory.nvme_checkpoints
    disk = tr.hw.disk_note() if tr.predicts and on_disk else ""
    r = tr.ranks
    return [
        *(
            [
                f"ranks: {r.size} ({r.local_size} on this host), each taking {tc.batch_size // r.size} rows of "
                f"every batch and holding 1/{r.size} of every slab; the tiers below are rank 0's"
            ]
            if r.size > 1
            else []
        ),
        f"model: {human_count(spec.n_params)} parameters"
        + (f" ({human_count(spec.n_active_params)} active)" if spec.is_moe else "")
        + f", {len(tr.units)} units "
        f"({spec.num_hidden_layers} blocks), {spec.flops_per_token(tc.seq_len) / 1e9:.3g} GFLOP/token",
        *(f"note: {u}; this model trains, but `tiertrain export` refuses it" for u in unlike_family(spec)),
        f"batch: {tc.batch_size} x {tc.seq_len} tokens in micro-batches of {tr.run_plan.micro_batch}, "
        f"compute {tc.compute_dtype} on {tr.device}, data: {tr.loader.describe()}",
        f"host tier: {human_bytes(sum(host.values()))} ("
        + ", ".join(f"{getattr(k, 'value', k)} {human_bytes(v)}" for k, v in host.items())
        + ")",
        *(
            [
                f"NVMe tier: {human_bytes(sum(nv.values()))} ("
                + ", ".join(f"{k.value} {human_bytes(v)}" for k, v in nv.items())
                + f") in {nvme.store.root} via {nvme.store.io.name}, staging ring "
                + human_bytes(nvme.ring_nbytes())
            ]
            if nvme
            else []
        ),
        *(
            [
                f"plan: step {num(pr.step_s)} s"
                + (
                    f" ({num(pr.clipped_step_s)} s while the global norm clips: then nothing speculates)"
                    if pr.clipped_step_s > pr.step_s * 1.005
                    else ""
                )
                + f", {num(pr.tokens_per_s)} tok/s, bottleneck "
                f"{pr.bottleneck}, GPU {tr.plan.memory.gpu.total / 1e9:.1f} GB ({tr.plan.hardware})"
            ]
            if tr.predicts
            else []
        ),
        *([disk] if disk else []),
        f"device: {human_bytes(tr.device_nbytes())} in weight slots, gradient accumulators and "
        f"GPU updates' state, "
        f"plus activations ({_checkpoint_homes(tr)}); "
        f"weights stream as "
        f"{'the compute-dtype copy' if Kind.WEIGHTS in tr.run.host.kinds else 'fp32 master'}"
        + (f" ({', '.join(tr.chosen)}: the plan)" if tr.chosen else ""),
    ]
