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
import io
import json
import locale
import os
import resource
import subprocess
import sys
from pathlib import Path

# read at a process's start or as it imports (the interpreter, the loader, libc, the locale, OpenMP, OpenBLAS, MKL,
# CUDA, torch, zarr, tiertrain's probe file under HOME): a fork would not see them changed
AT_START = (
    "PYTHON",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "GOTO",
    "CUDA_",
    "NVIDIA_",
    "TORCH_",
    "PYTORCH_",
    "ZARR_",
    "SYMPY_",
    "LD_",
    "MALLOC_",
    "GLIBC_",
    "LANG",
    "LC_",
    "TZ",
    "HOME",
)

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
# output goes through pipes, as subprocess.run's does (a file size limit does not hold them). What the imports
# print (a warning) would be each run's, and is not: where they print anything, no run is forked
SERVER = r"""
import gc, importlib, json, os, resource, runpy, selectors, sys, tempfile, types, warnings
reply = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDWR)
said = tempfile.TemporaryFile()
saved_err = os.dup(2)
os.dup2(said.fileno(), 1)
os.dup2(said.fileno(), 2)
for name in PRELOAD:
    importlib.import_module(name)
import torch
sys.stdout.flush()
sys.stderr.flush()
os.dup2(null, 1)
os.dup2(saved_err, 2)
os.close(saved_err)
quiet = os.fstat(said.fileno()).st_size == 0
said.close()
gc.freeze()  # the children's collections leave the server's objects alone
filters = warnings.filters[:]  # each child's, as a fresh process has them
# the thread numpy's OpenBLAS starts at import: Python 3.12 warns of any fork beside a thread (a DataLoader's too)
warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
pid = os.fork()  # whether a child may use CUDA (torch poisons a fork where the parent asked CUDA anything)
if pid == 0:
    os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
cuda = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
reply.write(json.dumps({"fork": quiet and cuda}) + "\n")
reply.flush()
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
        warnings.filters[:] = filters
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        if req["fsize"] is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
        if req["code"] is None:
            sys.path[0] = req["cwd"]  # as -m sets it
            sys.argv = ["-m", *req["args"]]
            runpy.run_module("tiertrain", run_name="__main__", alter_sys=True)
        else:  # as -c runs it: in a module __main__ of its own
            sys.path[0] = ""
            sys.argv = ["-c", *req["args"]]
            main = types.ModuleType("__main__")
            main.__spec__ = None
            sys.modules["__main__"] = main
            exec(compile(req["code"], "<string>", "exec"), main.__dict__)
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
    sel.close()
    _, status = os.waitpid(pid, 0)
    # the bytes as they came (surrogates for what is not UTF-8): the client decodes them as subprocess.run would
    out, err = (b"".join(got[fd]).decode(errors="surrogateescape") for fd in (out_r, err_r))
    reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status), "out": out, "err": err}) + "\n")
    reply.flush()
"""
# the environment and directory the server starts in: this process's as the tests begin (not a test's own)
START_ENV, START_CWD = dict(os.environ), os.getcwd()


class _Server:
    """The forking server of this test process (closed at its exit)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.tried = False  # started once: a server that failed or died is not started again
        self.usable = (
            False  # whether its forks may run (CUDA too, where torch has it) as fresh processes would
        )

    def start(self) -> None:
        self.tried = True
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"PRELOAD = {PRELOAD!r}\n{SERVER}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=START_ENV,
            cwd=START_CWD,
        )
        atexit.register(self.close)
        line = self.proc.stdout.readline()  # nothing: it failed to start (its error is on stderr)
        self.usable = bool(line) and json.loads(line)["fork"]  # else every run is a fresh interpreter

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def forks(self, env: dict[str, str]) -> bool:
        """Whether a run with this environment may be forked from the server (else: a fresh interpreter)."""
        if os.environ.get("TIERTRAIN_TEST_FORK", "1") == "0":
            return False
        if not self.tried:
            self.start()
        if not self.usable or self.proc.poll() is not None:
            return False
        keys = {k for k in {*env, *START_ENV} if k.startswith(AT_START)}
        return all(env.get(k) == START_ENV.get(k) for k in keys)

    def run(self, code: str | None, args: list[str], cwd: str, env: dict[str, str], fsize: int | None):
        """(exit status, stdout, stderr) of one run in a forked child: `python -c code ARGS`, or where code is
        None `python -m tiertrain ARGS`. A call cut short (an interrupt, a timeout) kills the server, whose
        reply would otherwise be the next call's: later runs are fresh interpreters."""
        req = dict(code=code, args=args, cwd=cwd, env=env, fsize=fsize)
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the tests' fork server (tests/forkcli.py) died; its error is on stderr")
        except BaseException:
            self.usable = False
            self.proc.kill()
            self.proc.wait()
            raise
        got = json.loads(line)
        return got["rc"], _text(got["out"]), _text(got["err"])


def _text(s: str) -> str:
    """A child's output as subprocess.run(text=True) decodes it: the locale's encoding, strictly, and universal
    newlines."""
    raw = s.encode(errors="surrogateescape")
    return io.TextIOWrapper(io.BytesIO(raw), encoding=locale.getpreferredencoding(False)).read()


_SERVER = _Server()


def cli(
    *args, cwd=None, fsize: int | None = None, env=None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`python -m tiertrain ARGS` in a process of its own (see above); `fsize`: a file size limit in bytes (a full
    disk); `env`: its environment (default: this process's); `fresh`: a fresh interpreter, with its own string
    hashes and memory layout (runs compared bit for bit, where an order that differs from process to process
    would show)."""
    return _python(None, [str(a) for a in args], cwd, fsize, env, fresh)


def python_c(code: str, *args, cwd=None, env=None) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS` in a process of its own, as cli's."""
    return _python(code, [str(a) for a in args], cwd, None, env, False)


def _python(
    code: str | None, args: list[str], cwd, fsize: int | None, env, fresh: bool
) -> subprocess.CompletedProcess:
    argv = [sys.executable, *(["-m", "tiertrain"] if code is None else ["-c", code]), *args]
    env = dict(os.environ if env is None else env)
    # `plan`, --help and --version import no torch: a fresh interpreter starts faster than a fork exits
    light = code is None and (not args or args[0] == "plan" or args[0].startswith("-"))
    if fresh or light or not _SERVER.forks(env):
        limit = None if fsize is None else (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize)))
        return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, preexec_fn=limit, env=env)
    rc, out, err = _SERVER.run(code, args, str(Path(cwd or os.getcwd()).resolve()), env, fsize)
    return subprocess.CompletedProcess(argv, rc, out, err)
