"""Pinned slabs made and dropped from several threads at once (tiers/slab.alloc_slab with pin=True): counts the
cudaHostRegister failures. A slab unregistered after its range was unmapped lets another thread map that range
again and find it still registered (CUDA error 712, cudaErrorHostMemoryAlreadyRegistered).

    python dev/pin_race.py [--threads 4] [--seconds 10] [--pages 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiertrain.tiers.slab import PAGE, alloc_slab  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument(
        "--pages", type=int, default=16, help="each slab's size in 4 KiB pages (equal sizes reuse ranges)"
    )
    a = ap.parse_args()
    torch.cuda.init()
    made, errors, stop = [0], [], time.monotonic() + a.seconds

    def churn() -> None:
        while time.monotonic() < stop:
            try:
                slab = alloc_slab(a.pages * PAGE // 4, torch.float32, pin=True)
            except MemoryError as e:
                errors.append(str(e))
                continue
            made[0] += 1
            del slab  # unregistered and unmapped here, while the other threads map theirs

    threads = [threading.Thread(target=churn) for _ in range(a.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"slabs": made[0], "failed": len(errors), "first": errors[:1], **vars(a)}))


if __name__ == "__main__":
    main()
