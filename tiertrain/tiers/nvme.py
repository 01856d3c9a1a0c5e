"""NVMe tier: one Zarr v3 group per run, an array per kind, one uncompressed chunk per unit.

Plain `zarr` opens and reads the store (shape (units, elements of the kind's widest spilled slab), a
chunk per unit, the model and layout in the attributes). Only the chunks of spilled units exist (the others read as zeros, and
are never used); every one of them is written at creation, so the hot path never creates, grows
or renames a file: it reads and writes the chunk files' bytes in place (`<kind>/c/<unit>/0`, raw
little-endian), with direct I/O into page-aligned buffers, split into 16 MiB tasks over a thread
pool. kvikio moves the bytes where it can run (it needs a CUDA driver); elsewhere os.preadv/pwritev.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..modes import Kind
from ..sizes import gb

TASK_BYTES = 16 << 20
FORMAT = "tiertrain-nvme/1"


class StoreError(UserError):
    pass


def _open(path: Path, write: bool) -> int:
    flags = os.O_RDWR if write else os.O_RDONLY
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0))
    except OSError as e:
        if e.errno != errno.EINVAL:  # the file system refuses direct I/O (tmpfs): buffered I/O then
            raise
        return os.open(path, flags)


class PosixIO:
    """pread/pwrite of whole chunk files in TASK_BYTES pieces on a thread pool, which close() shuts (its owner:
    the NvmeStore, a checkpoint's save or load, the probe)."""

    name = "posix"

    def __init__(self, threads: int = 16):
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="tiertrain-io")

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _run(self, path: Path, buf: torch.Tensor, write: bool, at: int = 0) -> Future:
        """The file's bytes from `at` read into (written from) `buf` in pieces on the pool. Its descriptor closes
        once, after the last piece that ran: a piece the pool refused (shut meanwhile) counts as done."""
        view = memoryview(buf.view(torch.uint8).numpy())
        offsets = range(0, len(view), TASK_BYTES)
        fd = _open(path, write)
        done: Future = Future()
        parts: list[Future] = []
        lock, left = threading.Lock(), [len(offsets)]

        def finish(n: int) -> None:
            with lock:  # the pieces end on several threads: one of them, the last, closes
                left[0] -= n
                if left[0]:
                    return
            os.close(fd)
            errs = [p.exception() for p in parts if p.exception()]
            if not errs:
                return done.set_result(len(view))
            e = errs[0]
            if isinstance(e, OSError) and e.filename is None:  # pread/pwrite name no file: say which
                e = OSError(e.errno, e.strerror, str(path))
            done.set_exception(e)

        if not offsets:
            finish(0)
        for i, o in enumerate(offsets):
            try:
                part = self.pool.submit(self._piece, fd, view[o : o + TASK_BYTES], at + o, write)
            except BaseException:
                finish(len(offsets) - i)  # these never run
                raise
            parts.append(part)
            part.add_done_callback(lambda _: finish(1))
        return done

    @staticmethod
    def _piece(fd: int, view: memoryview, offset: int, write: bool) -> None:
        n = (os.pwritev if write else os.preadv)(fd, [view], offset)
        if n != len(view):
            raise OSError(errno.EIO, f"short {'write' if write else 'read'}: {n} of {len(view)} bytes")

    def read(self, path: Path, buf: torch.Tensor, at: int = 0) -> Future:
        """Reads the file's bytes from offset `at` into `buf`."""
        return self._run(path, buf, False, at)

    def write(self, path: Path, buf: torch.Tensor, at: int = 0) -> Future:
        return self._run(path, buf, True, at)


class KvikioIO:
    """kvikio's thread pool (compatibility mode without GPUDirect Storage); needs a CUDA driver. Its own
    threads wait on kvikio's futures (close() shuts them)."""

    name = "kvikio"

    def __init__(self, threads: int = 16):
        import kvikio
        import kvikio.defaults

        kvikio.defaults.set({"num_threads": threads, "task_size": TASK_BYTES})
        self.kvikio = kvikio
        self.waiters = ThreadPoolExecutor(4, thread_name_prefix="tiertrain-io-wait")

    def close(self) -> None:
        self.waiters.shutdown(wait=True)

    def _run(self, path: Path, buf: torch.Tensor, write: bool) -> Future:
        f = self.kvikio.CuFile(path, "r+" if write else "r")
        arr = buf.view(torch.uint8).numpy()
        io = f.pwrite(arr) if write else f.pread(arr)
        done: Future = Future()

        def wait():  # kvikio's future does not keep the buffer alive: arr is held until here
            try:
                done.set_result(io.get())
            except Exception as e:  # noqa: BLE001 - handed to the waiter
                done.set_exception(e)
            finally:
                f.close()

        self.waiters.submit(wait)
        return done

    def read(self, path: Path, buf: torch.Tensor) -> Future:
        return self._run(path, buf, write=False)

    def write(self, path: Path, buf: torch.Tensor) -> Future:
        return self._run(path, buf, write=True)


def check_backend(backend: str) -> None:
    """tiers.io = "kvikio" needs the package: said before anything is allocated."""
    if backend == "kvikio":
        try:
            import kvikio  # noqa: F401
        except ImportError:
            cuda = (torch.version.cuda or "12").split(".")[0]  # a CPU build: the common CUDA 12
            raise StoreError(
                f'tiers.io = "kvikio" but kvikio is not installed: pip install "tiertrain[cu{cuda}]" '
                f'(kvikio for this torch\'s CUDA {cuda}), or set tiers.io = "auto" (POSIX I/O where '
                "kvikio is missing)"
            ) from None


def make_io(backend: str = "auto", threads: int = 16, where: Path | None = None):
    """`auto`: kvikio when it imports and can do I/O here (a trial read in `where`, a directory of tiertrain's
    own: a run's scratch store; None, as for the probe: the temporary directory), else POSIX."""
    if backend in ("auto", "kvikio"):
        try:
            io = KvikioIO(threads)
            try:
                _trial_read(io, where)
            except BaseException:
                io.close()
                raise
            return io
        except Exception as e:  # noqa: BLE001 - kvikio missing, or no CUDA driver (CI)
            if backend == "kvikio":
                raise StoreError(
                    f"the kvikio I/O backend cannot run here ({type(e).__name__}: {e}); "
                    'use --set tiers.io="posix"'
                ) from None
    return PosixIO(threads)


def _trial_read(io, where: Path | None) -> None:
    # a new file of its own: no link followed, nothing clobbered; gone whatever fails
    fd, name = tempfile.mkstemp(prefix=".tiertrain-kvikio-", dir=where)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(4096))
        io.read(Path(name), torch.zeros(4096, dtype=torch.uint8)).result()
    finally:
        os.unlink(name)


class ChunkStore:
    """What the NVMe stores share: a directory of chunk files made whole at creation, whose bytes the I/O backend
    (kvikio or POSIX) reads and writes in place. A store names each chunk's file by its two keys (`file`); it owns
    its backend's threads, which close() shuts."""

    def __init__(self, root: str | os.PathLike, io):
        self.root, self.io = Path(root), io

    def file(self, a, b) -> Path:
        raise NotImplementedError

    def read(self, a, b, buf: torch.Tensor) -> Future:
        """Reads chunk (a, b) into `buf` (page-aligned, the chunk's size)."""
        return self.io.read(self.file(a, b), buf)

    def write(self, a, b, buf: torch.Tensor) -> Future:
        return self.io.write(self.file(a, b), buf)

    def close(self) -> None:
        self.io.close()

    def check_room(self, need: int, what: str, fix: str) -> None:
        """Refuses a store whose `need` bytes the disk has not free, saying `what` needs them and the `fix`."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.root).free
        except OSError as e:
            raise StoreError(
                f"cannot use --nvme-dir {self.root}: {e.strerror}; pass a writable directory"
            ) from None
        if need > free:
            raise StoreError(f"--nvme-dir {self.root.parent} has {gb(free)} free, {what} {gb(need)}; {fix}")


class NvmeStore(ChunkStore):
    """The spilled slabs of a run: array `kind`, row `unit`, elements [0, numel(unit)); a kind's rows are
    as wide as its widest spilled unit. Its chunks are keyed (unit, kind)."""

    def __init__(
        self,
        root: str | os.PathLike,
        numels: list[int],
        kinds: dict[Kind, str],
        meta: dict,
        io,
        create: bool,
        units: dict[str, list[int]] | None = None,
    ):
        """`create`: a new store (a store already there is refused, never reused: its contents belong to
        another run); otherwise open an existing one, checked against `meta` and for whole chunks.
        `units`: the rows of each kind that are spilled (default all); only their chunks exist on disk."""
        import zarr

        super().__init__(root, io)
        self.numels, self.kinds = numels, kinds
        self.units = {k: sorted(units[k]) if units else list(range(len(numels))) for k in kinds}
        # a kind's rows as wide as its widest spilled unit: a wide unit kept in RAM costs no disk
        self.width = {k: max((numels[u] for u in self.units[k]), default=1) for k in kinds}
        meta = {
            "format": FORMAT,
            "numels": numels,
            "kinds": {k.value: dt for k, dt in kinds.items()},
            "units": {k.value: us for k, us in self.units.items()},
            **meta,
        }
        exists = (self.root / "zarr.json").exists()
        if create and exists:
            raise StoreError(
                f"{self.root} already holds a store of another run; use a new --out name or "
                "--nvme-dir, or delete it"
            )
        if not create and not exists:
            raise StoreError(f"{self.root} holds no tiertrain store; check --nvme-dir")
        if exists:
            try:
                found = dict(zarr.open_group(self.root, mode="r").attrs)
            except Exception as e:  # noqa: BLE001 - any unreadable store
                raise StoreError(
                    f"{self.root} holds an unreadable Zarr store ({e}); use another --nvme-dir or delete it"
                ) from None
            if found != json.loads(json.dumps(meta)):
                raise StoreError(
                    f"{self.root} holds a store made for a different model or config; use another "
                    "--nvme-dir or delete it"
                )
            self._check_chunks()
            return
        self._create(meta)

    def _create(self, meta: dict) -> None:
        import zarr

        need = sum(self.width[k] * np.dtype(dt).itemsize * len(self.units[k]) for k, dt in self.kinds.items())
        self.check_room(need, "the spilled state needs", "free space, or raise --host-gb to spill less")
        try:
            g = zarr.open_group(self.root, mode="a", attributes=meta)  # never "w": that empties the directory
            for kind, dt in self.kinds.items():
                w = self.width[kind]
                arr = g.create_array(
                    kind.value,
                    shape=(len(self.numels), w),
                    chunks=(1, w),
                    dtype=dt,
                    fill_value=0,
                    compressors=None,
                    config={"write_empty_chunks": True},
                )
                zeros = np.zeros((1, w), dtype=dt)
                for u in self.units[kind]:
                    arr[u : u + 1] = zeros
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StoreError(
                    f"the disk of --nvme-dir {self.root} filled up while creating the store; free "
                    "space or raise --host-gb"
                ) from None
            raise StoreError(f"cannot create the store in {self.root}: {e.strerror}") from None

    def _check_chunks(self) -> None:
        for kind, dt in self.kinds.items():
            for u in self.units[kind]:
                p = self.path(kind, u)
                if not p.is_file() or p.stat().st_size != self.width[kind] * np.dtype(dt).itemsize:
                    raise StoreError(
                        f"{self.root}: chunk {kind.value}/{u} is missing or truncated; the store is "
                        "corrupt: use another --nvme-dir or delete it"
                    )

    def path(self, kind: Kind, unit: int) -> Path:
        return self.root / kind.value / "c" / str(unit) / "0"

    def file(self, unit: int, kind: Kind) -> Path:
        return self.path(kind, unit)


SCRATCH_MARKER = "tiertrain-scratch.json"  # in every directory new_scratch makes, and only there
MADE = re.compile(r"tiertrain-.*-[a-z0-9_]{8}")  # the names new_scratch gives
SCRATCH_FD = "TIERTRAIN_SCRATCH_FD"  # the launcher's pipe, where a rank writes each store it makes


def new_scratch(parent: str | os.PathLike, run: str) -> Path:
    """A new directory for a run's store inside `parent` (the user's --nvme-dir), with a unique name and the
    marker that lets discard delete it: nothing that was there before is ever emptied or reused."""
    import socket
    import tempfile
    import time

    parent = Path(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix=f"tiertrain-{Path(run).name or 'run'}-", dir=parent))
        (root / SCRATCH_MARKER).write_text(
            json.dumps(
                {
                    "format": FORMAT,
                    "run": run,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                }
            )
            + "\n"
        )
        told = os.environ.get(SCRATCH_FD)
        # a rank of `run --gpus N`: its launcher deletes the store if it sees the rank killed. Only into the pipe
        # (a process the rank starts inherits the variable, not the descriptor)
        with contextlib.suppress(OSError, ValueError):
            if told and stat.S_ISFIFO(os.fstat(int(told)).st_mode):
                os.write(int(told), f"{root}\n".encode())  # one write below PIPE_BUF: whole in the pipe
    except OSError as e:
        raise StoreError(
            f"cannot use --nvme-dir {parent}: {e.strerror}; pass a writable directory with room"
        ) from None
    return root


def _owner(root: Path) -> dict | None:
    try:
        found = json.loads((root / SCRATCH_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("format") == FORMAT else None


def discard(root: str | os.PathLike) -> None:
    """Deletes a scratch store, and only a directory new_scratch made (it carries the marker; a symbolic link is
    never followed or deleted through): the state is in the checkpoints, and a resumed run makes a new store."""
    root = Path(root)
    if not root.is_symlink() and root.is_dir() and _owner(root) is not None:
        # the marker last: a process killed midway leaves a store that still says whose it is, which the run's
        # next start deletes (discard_stale), where an unmarked one would stay on the disk for good
        for p in root.iterdir():
            if p.name == SCRATCH_MARKER:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        shutil.rmtree(root)


def discard_stale(parent: str | os.PathLike) -> list[Path]:
    """Deletes the scratch stores (the state's and the activation checkpoints') left in `parent` by processes of this
    host that are gone (killed), of any run: a run restores its state from a checkpoint, so such a
    store is never read again, and would only fill the disk (a run refused after a kill, or never resumed, left
    them for good). Also an empty directory of a store's name a minute old (a process killed before it marked
    it). One process per host calls it (the run's first rank there) while the others wait. Returns what it
    deleted."""
    import socket
    import time

    import psutil

    parent = Path(parent)
    if parent.is_symlink() or not parent.is_dir():
        return []
    gone = []
    for d in parent.glob("tiertrain-*"):
        if d.is_symlink() or not d.is_dir():
            continue
        o = _owner(d)
        if o and o.get("host") == socket.gethostname() and not psutil.pid_exists(int(o.get("pid", 0) or 0)):
            shutil.rmtree(d)
            gone.append(d)
        # new_scratch's name (mkdtemp's 8 characters): an empty directory of a user's other name stays
        elif o is None and MADE.fullmatch(d.name) and time.time() - d.stat().st_mtime > 60:
            with contextlib.suppress(OSError):
                d.rmdir()  # only where empty: a directory with anything in it is not one new_scratch left
                gone.append(d)
    return gone
