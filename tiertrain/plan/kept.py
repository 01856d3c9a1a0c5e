"""What stays on the GPU from a step's forward pass to its backward pass, beside the checkpoints (the planner's memory
stage after the host's and the disk's: it takes what they leave): the last blocks' whole graphs (kept activations:
no recompute), and the attention outputs of the last recomputed blocks (their recompute runs no attention). Pure
Python. Each stage takes the choice's memory.Shape (`s`), the memory so far and the placement."""

from __future__ import annotations

from dataclasses import replace

from ..modes import Kind
from ..tiers.placement import update_candidates
from .attention import attention_out_bytes, keeping_blocks, keeps_outputs, kv_graph
from .values import Memory
from .workset import KEPT_SLACK, kept_bytes_per_token

# a kept block's backward pass above its graph, in H-wide bytes per token: 14.1-16.1 measured
# (bench/results/2026-11-27-H200-kept-backward.md, dev/kept_workset.py)
KEPT_WORK_H = 16.5


def kept_blocks(s, mem: Memory, where: dict) -> Memory:
    """The last blocks that keep their activations (their graph on the GPU, no recompute): the choice's, else as
    many as the GPU memory left holds, room for one GPU update's two state sets first."""
    job, spec, choice = s.job, s.job.spec, s.choice
    tiled = bool(s.run_plan.tile) and choice.micro * job.seq_len > s.run_plan.tile
    # kept activations replace a block's checkpoint (where it is on the GPU) with its whole saved graph
    kv = kv_graph(s.run_plan.attention, s.run_plan.deterministic, job.dtype, spec)
    # a graph's input is the last one's output (counted there); from a bf16 checkpoint it is an fp32 copy of its
    # rounding beside it (engine/keep.forward)
    rounded = 4 * spec.hidden_size if job.activation_dtype != "float32" else 0
    per_token = kept_bytes_per_token(spec, job.dtype, kv, job.seq_len) + rounded
    per_kept = KEPT_SLACK * per_token * s.tokens - (s.ck_unit if choice.activations == "gpu" else 0)
    keep = choice.keep
    if choice.activations == "split" and keep is None:
        keep = 0  # split: memory is short, and a kept block's graph takes several checkpoints' room
    if keep is None and tiled:
        keep = 0  # a kept block runs untiled: its graph and working set grow with the MLP's width times the length
    if keep is None and kv == "math":
        keep = 0  # the math kernel's graph saves the attention weights: length squared
    if keep is None:  # room for one GPU update's two sets first: they save more than a block's recompute
        keep = int(max(0.0, s.gpu_budget - mem.gpu.total - _update_sets(s, where)) // per_kept)
    kept = min(keep, spec.num_hidden_layers)
    if not kept:
        return mem
    # shown gross: the blocks kept have no checkpoint
    saved = kept * s.ck_unit if choice.activations == "gpu" else 0
    graphs = kept * KEPT_SLACK * per_token * s.tokens
    # a kept block runs untiled (engine/keep.forward), so a forced keep under tiling pays what the tiled plan does
    # not: its backward pass's peak (a micro-batch's) where above the tiled working set, and the fp32 outputs its
    # graphs hold (every micro-batch's)
    if tiled:
        H = spec.hidden_size
        graphs += max(0.0, KEPT_WORK_H * H * choice.micro * job.seq_len - mem.gpu.working) + s.tokens * H * 4
    gpu = replace(mem.gpu, kept=graphs, checkpoints=mem.gpu.checkpoints - saved)
    return replace(mem, gpu=gpu, kept=kept, kept_checkpoints=saved)


def _update_sets(s, where: dict) -> int:
    """GPU bytes of one GPU update's two state sets (the largest candidate's), where the choice may update any on
    the GPU: what the kept activations leave room for."""
    if s.choice.gpu_updates == 0:
        return 0
    cands = gpu_candidates(
        [u for u in update_candidates(where, s.kb, len(s.shards)) if u not in s.resident], s.kb
    )
    return 2 * 16 * max((s.numels[u] for u in cands), default=0)


def kept_attention(s, mem: Memory, where: dict) -> Memory:
    """The last recomputed blocks whose attention outputs and log-sum-exps stay on the GPU from the forward pass
    (every micro-batch's), so that their recompute runs no attention: the choice's, else, where the plan tiles the
    blocks (long rows, whose step is mostly attention), as many as the GPU memory left holds, none kept for GPU
    updates (shorter rows keep none unless asked: a few percent of their step at best, in memory the plan gives
    to checkpoints, resident state and kept blocks as measured); none where nothing could keep them (a kernel
    with no such ops, rows of segments: plan.attention.check_kept)."""
    job, spec, rp = s.job, s.job.spec, s.run_plan
    blocks = attention_blocks(spec, job.seq_len, mem.kept)
    per_block = KEPT_SLACK * s.tokens * attention_out_bytes(spec, job.dtype)
    keep = s.choice.keep_attention
    if not blocks or not keeps_outputs(rp.attention, s.hw.unified, spec.hd) or job.segmented:
        keep = 0
    elif keep is None and not (rp.tile and s.choice.micro * job.seq_len > rp.tile):
        keep = 0
    elif keep is None:  # no room kept for GPU updates: beside a tiled block's long passes the host's hides
        keep = int(max(0.0, s.gpu_budget - mem.gpu.total) // per_block)
    kept = min(keep, len(blocks))
    if not kept:
        return mem
    return replace(mem, gpu=replace(mem.gpu, kept_attention=kept * per_block), kept_attention=kept)


def attention_blocks(spec, seq_len: int, kept: int) -> list[int]:
    """The blocks that may keep their attention outputs, in the order the plan takes them (the last first):
    recomputed ones (below the `kept` last blocks) whose attention is causal over the whole row."""
    nl = spec.num_hidden_layers
    return [b for b in keeping_blocks(spec, seq_len) if b <= nl - kept][::-1]


def gpu_candidates(in_ram: list[int], kb: dict) -> list[int]:
    """The units that may be updated on the GPU: those in RAM, unless a compute-dtype copy streams (a GPU update
    makes the weights from the fp32 master)."""
    return in_ram if Kind.WEIGHTS not in kb else []
