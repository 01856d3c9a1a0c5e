"""Whether SDPA's forward pass gives the same bits with autograd on and off, per kernel (docs/moe.md): an expert
group's recompute routes by the attention part's output, so its backward pass must choose the experts its forward
pass chose. Llama3.1-8b's heads (32 query, 8 key/value, 128 wide), causal, bf16, on one GPU.

    python dev/sdpa_bits.py [--tokens 4096 16384] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import commit  # noqa: E402

KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    r = {"code": commit(), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "runs": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for t in a.tokens:
        q, k, v = (
            torch.randn(1, n, t, 128, device="cuda", dtype=torch.bfloat16, generator=g) for n in (32, 8, 8)
        )
        for name, kernel in KERNELS.items():
            with sdpa_kernel([kernel]):
                with torch.no_grad():
                    off = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                on = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True).detach()
            diff = (off.float() - on.float()).abs().max().item()
            r["runs"].append(
                {"tokens": t, "kernel": name, "same_bits": torch.equal(off, on), "max_diff": diff}
            )
            print(r["runs"][-1], flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
