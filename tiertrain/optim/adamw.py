"""Host AdamW over slabs, global-norm clipping, and the learning-rate schedule.

Semantics are torch.optim.AdamW's (decoupled weight decay, bias correction) applied with torch's fused
CPU kernel, one call per contiguous range of a unit's slabs: the decayed tensors (2 or more dims) and
the rest. Clipping follows torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6),
applied when below 1.
"""
from __future__ import annotations

import math

import torch

from ..config import OptimConfig
from ..errors import UserError
from ..tiers.host import HostStore
from ..tiers.slab import SlabLayout


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (from 0): linear warmup, then constant or cosine to min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def clip_coefficient(norms: list[torch.Tensor], max_norm: float) -> tuple[float, float]:
    """(global grad norm, factor to multiply the gradients by); factor 1.0 when clipping is off."""
    total = float(torch.linalg.vector_norm(torch.stack([n.float().cpu() for n in norms])))
    if not math.isfinite(total):
        raise UserError(f"the gradient norm is {total}: training diverged; lower optim.lr or "
                        "set optim.grad_clip, and check the data")
    if max_norm <= 0:
        return total, 1.0
    return total, min(1.0, max_norm / (total + 1e-6))


class HostAdamW:
    def __init__(self, host: HostStore, layouts: list[SlabLayout], cfg: OptimConfig):
        self.host, self.layouts, self.cfg = host, layouts, cfg
        self.step_count = 0  # completed updates; every tensor shares it, as in torch.optim.AdamW

    def update(self, lr: float, clip: float) -> None:
        self.step_count += 1
        for unit in range(len(self.layouts)):
            self.update_unit(unit, lr, clip)

    def update_unit(self, unit: int, lr: float, clip: float) -> None:
        s = self.host.slabs[unit]
        if clip < 1.0:
            s["grad"].mul_(clip)
        b1, b2 = self.cfg.betas
        step = torch.tensor(float(self.step_count))
        for a, b, decay in self.layouts[unit].ranges():
            torch._fused_adamw_([s["master"][a:b]], [s["grad"][a:b]], [s["exp_avg"][a:b]],
                                [s["exp_avg_sq"][a:b]], [], [step], lr=lr, beta1=b1, beta2=b2,
                                weight_decay=self.cfg.weight_decay if decay else 0.0, eps=self.cfg.eps,
                                amsgrad=False, maximize=False)
        self.host.refresh_weights(unit)
