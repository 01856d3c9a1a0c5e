"""The one translation of a Config into the planner's search, for `tiertrain plan` and `tiertrain run` alike:
what the config fixes stays fixed, what it leaves "auto" is searched. Pure Python."""
from __future__ import annotations

from ..config import AUTO, Config, fixed
from .hardware import HardwareSpec
from .planner import Budgets, Plan, plan


def search(cfg: Config, hw: HardwareSpec, host_gb: float | None, gpu_gb: float | None, nvme_gb: float | None,
           name: str, micro: int | None = None, advise: bool = True) -> Plan:
    """The plan of `cfg` under these budgets (None: see Budgets). `micro`: the micro-batch a resumed run ran
    with, kept where the config leaves it to the plan."""
    t, tc, o = cfg.tiers, cfg.train, cfg.optim
    stream = fixed(t.stream)
    if t.gpu_update_units not in (AUTO, 0) and tc.compute_dtype == "bfloat16" and stream is None:
        stream = "master"  # the GPU update makes the weights from the fp32 master
    return plan(cfg.model, tc.batch_size, tc.seq_len, tc.compute_dtype,
                Budgets(host_gb, gpu_gb, nvme_gb, t.gpu_resident_gb), hw, name=name, advise=advise,
                gpu_updates=t.gpu_update_units, micro=fixed(tc.micro_batch_size) or micro,
                clipping=o.grad_clip > 0, speculate=fixed(o.speculate_units),
                speculate_gpu=fixed(o.speculate_gpu_updates), stream=stream, activations=fixed(t.activations))
