"""`tiertrain run --gpus N`: the torchrun job of N ranks on this host, one process per GPU, with torchrun's
environment (WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and its env://
rendezvous; `torchrun --nproc-per-node N -m tiertrain run ...` is the same job. The first rank to fail stops
the others at once (SIGKILL: they cannot save without it, and the last checkpoint is whole whatever moment
they stop at), and its exit status is the job's; SIGINT and SIGTERM are passed on to every
rank (each then finishes its step, they save a checkpoint together and stop)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, args: list[str], stdout=None, module: str | None = "tiertrain") -> int:
    """Runs `python -m <module> <args>` (module None: `python <args>`) as n ranks, their output to `stdout`
    (None: this process's); returns the job's exit status."""
    port, cores = _free_port(), os.cpu_count() or 1
    procs = []
    for r in range(n):
        env = dict(
            os.environ,
            WORLD_SIZE=str(n),
            RANK=str(r),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(n),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        # the host's cores shared, as torchrun would
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // n)))
        cmd = [sys.executable, *(["-m", module] if module else []), *args]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None)
        )

    def forward(signum, frame) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None:
                _stop(procs, kill=True)
                return failed if failed > 0 else 128 - failed
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _stop(procs)


def _stop(procs: list[subprocess.Popen], kill: bool = False) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill() if kill else p.terminate()
    deadline = time.monotonic() + 30
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
