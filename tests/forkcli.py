"""`python -m tiertrain ARGS` as a process of its own, forked from a server that has imported torch and tiertrain.

Each run is still a process as a user's is: its own arguments (sys.argv as `-m` sets it), directory, environment,
file size limit, exit status and output, and it exits through Python's own exit (atexit and all). What it skips
is the import of torch and tiertrain's modules, 3-4 s a run on CI's two cores, over the suite's 200-odd runs.

The server is one process per test process, started on first use and closed at its exit. It only imports: no
tensor op has run in it, so no OpenMP pool or thread of its own is lost in a fork (a DataLoader forks its workers
from far busier processes). It checks that a fork of it may use CUDA; where one may not, every run is a fresh
interpreter. So is a run whose environment differs from the server's in what a process reads at start or import
(PYTHONPATH, the OpenMP and MKL thread counts, CUDA's and torch's settings, the loader's paths), and every run
when TIERTRAIN_TEST_FORK is 0.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

# read by the interpreter, the loader, OpenMP, MKL, CUDA or torch at start or import: a fork would not see them
AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "CUDA_", "TORCH_", "LD_", "NVIDIA_", "PYTORCH_")

# what a run imports at 20 ms or more (python -X importtime), imported by the server before it forks; not
# torch.utils.cpp_extension, which asks CUDA for its devices as it is imported: a fork of a process that has may
# not use CUDA (the server checks that none of these did)
PRELOAD = (
    "torch",
    "torch.fx.experimental.symbolic_shapes",
    "zarr",
    "tiertrain.cli",
    "tiertrain.parallel",
    "tiertrain.start",
    "tiertrain.export",
    "tiertrain.plancmd",
)
# the server: a request a line on stdin, {"rc", "out", "err"} a line back; each request runs in a forked child whose
# output goes through pipes, as subprocess.run's does (a file size limit does not hold them)
SERVER = r"""
import json, os, resource, runpy, selectors, sys
import torch
import gc, importlib, warnings
for name in PRELOAD:
    importlib.import_module(name)
gc.freeze()  # the child's collections and exit then leave the server's objects alone: no copy on write
# torch's own thread from its import: Python 3.12 warns of any fork beside a thread (a DataLoader's too)
warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
pid = os.fork()  # whether a child may use CUDA (torch poisons a fork where the parent asked CUDA anything)
if pid == 0:
    os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
print(json.dumps({"fork": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0}), flush=True)
reply = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 1)
for line in sys.stdin:
    req = json.loads(line)
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        reply.close()
        os.close(out_r)
        os.close(err_r)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        if req["fsize"] is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
        sys.path[0] = req["cwd"]
        if req["code"] is None:
            sys.argv = ["-m", *req["args"]]
            runpy.run_module("tiertrain", run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *req["args"]]
            exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__"})
        sys.exit(0)
    os.close(out_w)
    os.close(err_w)
    got = {out_r: [], err_r: []}
    sel = selectors.DefaultSelector()
    for fd in got:
        sel.register(fd, selectors.EVENT_READ)
    while sel.get_map():
        for key, _ in sel.select():
            data = os.read(key.fd, 1 << 16)
            if data:
                got[key.fd].append(data)
            else:
                sel.unregister(key.fd)
                os.close(key.fd)
    _, status = os.waitpid(pid, 0)
    out, err = (b"".join(got[fd]).decode(errors="replace") for fd in (out_r, err_r))
    reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status), "out": out, "err": err}) + "\n")
    reply.flush()
"""


class _Server:
    """The forking server of this test process (closed at its exit)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.usable = False  # whether its forks may use CUDA (all may where torch has none)

    def start(self) -> None:
        self.env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"PRELOAD = {PRELOAD!r}\n{SERVER}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        atexit.register(self.close)
        line = self.proc.stdout.readline()  # nothing: it failed to start (its error is on stderr)
        self.usable = bool(line) and json.loads(line)["fork"]  # else every run is a fresh interpreter

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()

    def forks(self, env: dict[str, str]) -> bool:
        """Whether a run with this environment may be forked from the server (else: a fresh interpreter)."""
        if os.environ.get("TIERTRAIN_TEST_FORK", "1") == "0":
            return False
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        keys = {k for k in {*env, *self.env} if k.startswith(AT_START)}
        return self.usable and all(env.get(k) == self.env.get(k) for k in keys)

    def run(self, code: str | None, args: list[str], cwd: str, env: dict[str, str], fsize: int | None):
        """(exit status, stdout, stderr) of one run in a forked child: `python -c code ARGS`, or where code is
        None `python -m tiertrain ARGS`."""
        req = dict(code=code, args=args, cwd=cwd, env=env, fsize=fsize)
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        got = json.loads(self.proc.stdout.readline())
        return got["rc"], got["out"], got["err"]


_SERVER = _Server()


def cli(*args, cwd=None, fsize: int | None = None, env=None) -> subprocess.CompletedProcess:
    """`python -m tiertrain ARGS` in a process of its own (see above); `fsize`: a file size limit in bytes (a full
    disk); `env`: its environment (default: this process's)."""
    return _python(None, [str(a) for a in args], cwd, fsize, env)


def python_c(code: str, *args, cwd=None, env=None) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS` in a process of its own, as cli's."""
    return _python(code, [str(a) for a in args], cwd, None, env)


def _python(code: str | None, args: list[str], cwd, fsize: int | None, env) -> subprocess.CompletedProcess:
    argv = [sys.executable, *(["-m", "tiertrain"] if code is None else ["-c", code]), *args]
    env = dict(os.environ if env is None else env)
    # `plan`, --help and --version import no torch: a fresh interpreter starts faster than a fork exits
    light = code is None and (not args or args[0] == "plan" or args[0].startswith("-"))
    if light or not _SERVER.forks(env):
        import resource

        limit = None if fsize is None else (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize)))
        return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, preexec_fn=limit, env=env)
    rc, out, err = _SERVER.run(code, args, str(Path(cwd or os.getcwd()).resolve()), env, fsize)
    return subprocess.CompletedProcess(argv, rc, out, err)
