"""`tiertrain run --gpus N`: the torchrun job of N ranks on this host, one process per GPU, with torchrun's
environment (WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and its env://
rendezvous; `torchrun --nproc-per-node N -m tiertrain run ...` is the same job. The first rank to fail stops
the others at once (SIGKILL: they cannot save without it, and the last checkpoint is whole whatever moment
they stop at; the launcher then deletes the NVMe stores a killed rank leaves), and its exit status is the
job's, with a line saying which rank and how where it said nothing itself; a refusal (status 2), which the ranks meet together, lets the others end by themselves (rank 0 takes
back the run directory it claimed). SIGINT and SIGTERM are passed on to every rank (each then finishes its
step, they save a checkpoint together and stop; before the loop each gives back what it made), and a rank that
stops first waits for the others to. A launcher killed outright (SIGKILL, which it cannot pass on) takes its ranks
with it (follow_launcher), where they trained on unwatched, holding the run directory."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

LAUNCHER = "TIERTRAIN_LAUNCHER"  # the launcher's pid, in its ranks' environment


def follow_launcher() -> None:
    """A rank the launcher started dies with it: SIGKILL at its parent's death (Linux's PR_SET_PDEATHSIG), as where
    another rank fails (the last checkpoint is whole at any moment, and the next run in its --nvme-dir deletes the
    stores it leaves); at once where the launcher died before that was asked. Nothing under torchrun."""
    pid = os.environ.pop(LAUNCHER, None)  # popped: a process the rank starts is not the launcher's
    if pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != int(pid):
        os.kill(os.getpid(), signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, args: list[str], stdout=None, module: str | None = "tiertrain") -> int:
    """Runs `python -m <module> <args>` (module None: `python <args>`) as n ranks, their output to `stdout`
    (None: this process's); returns the job's exit status."""
    from .tiers.nvme import SCRATCH_FD

    port, cores = _free_port(), os.cpu_count() or 1
    procs = []
    made, told = os.pipe()  # the ranks' NVMe stores, deleted where a rank was killed before it could
    os.set_blocking(made, False)
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
            **{SCRATCH_FD: str(told), LAUNCHER: str(os.getpid())},
        )
        # the host's cores shared, as torchrun would
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // n)))
        cmd = [sys.executable, *(["-m", module] if module else []), *args]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None, pass_fds=(told,)
            )
        )
    os.close(told)
    stores: list[str] = []

    signalled = []

    def forward(signum, frame) -> None:
        signalled.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                r, code = failed
                # a refusal (2) the ranks met together, or a signal passed on to each: they stop by themselves
                # (rank 0 takes back the run directory it claimed, each rank its NVMe store); anything else
                # kills them at once
                _stop(procs, "wait" if code == 2 or signalled else "kill")
                if signalled:
                    return code if code > 0 else 128 - code
                if code < 0:
                    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else -code
                    print(
                        f"error: rank {r} was killed by {name}; the other ranks were stopped", file=sys.stderr
                    )
                elif code not in (1, 2):  # 1: its traceback, 2: its line
                    print(
                        f"error: rank {r} exited with status {code}; the other ranks were stopped",
                        file=sys.stderr,
                    )
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            _read(made, stores)  # as they come: the pipe holds only 64 KiB
            time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _stop(procs)
        _read(made, stores)
        os.close(made)
        _discard(stores)


def _read(pipe: int, into: list[str]) -> None:
    """The store paths the ranks have written to `pipe` since the last read."""
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(pipe, 1 << 16):
            data += chunk
    into += data.decode().splitlines()


def _discard(stores: list[str]) -> None:
    """Deletes the stores the ranks left: a rank that ended by itself deleted its own, one killed (by a signal, or
    by the launcher when another rank failed) could not. Only marked stores are deleted (nvme.discard)."""
    from .tiers.nvme import discard

    for root in stores:
        with contextlib.suppress(OSError):
            discard(root)


def _stop(procs: list[subprocess.Popen], how: str = "terminate", grace: float = 30.0) -> None:
    """The ranks still running sent SIGTERM or SIGKILL (`how`; "wait": nothing), then given `grace` seconds to
    end before they are killed."""
    for p in procs:
        if p.poll() is None and how != "wait":
            p.kill() if how == "kill" else p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
