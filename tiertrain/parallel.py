"""Several GPUs: the ranks of a `torchrun` job and the collectives a step makes (torch.distributed: NCCL on GPUs,
gloo on CPUs). A process started without torchrun is a job of one rank: nothing is initialized and every
collective is the identity.

Each rank owns 1/N of every unit's slabs (tiers.slab.Shard). The step copies a unit's weight shard over the
rank's own PCIe link and all-gathers the unit over NVLink (or the network), reduce-scatters each unit's
gradient so that each rank drains only its shard, and sums the squared norm and the loss in one all-reduce.
The process group routes each tensor by its device: CUDA tensors to NCCL, host tensors (checkpoint checksums,
state gathers, flags) to gloo.
"""

from __future__ import annotations

import os
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from .errors import ConfigError, ElsewhereError, Everywhere
from .launch import follow_launcher


def _dist():
    import torch.distributed as dist

    return dist


def _gather(out: torch.Tensor, part: torch.Tensor, group=None) -> None:
    dist = _dist()  # torch 2.13 renamed all_gather_into_tensor; the GPU machines run 2.11
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, part, group=group)


@dataclass
class Together:
    """What the ranks learned together on leaving a `with ranks.together(...)` block."""

    error: BaseException | None = None  # this rank's, caught in the block
    first: int | None = None  # the lowest rank that failed, the same on every rank; None: none did
    alike: bool = False  # every rank failed with the same words: the job's error, not one rank's

    @property
    def failed(self) -> bool:
        return self.first is not None

    def raise_any(self, rank: int) -> None:
        """Raises this rank's error where it is the first that failed, ElsewhereError where another is."""
        if self.first is None:
            return
        if self.first == rank and self.error is not None:
            if self.alike and not isinstance(self.error, Everywhere):
                raise Everywhere(str(self.error)) from self.error  # rank 0 says it, without a rank's number
            raise self.error
        raise ElsewhereError("another rank failed")


@dataclass
class Ranks:
    """This process's place in the job, and its collectives. Main thread only: every rank issues the same
    collectives in the same order (the step's, a checkpoint's, the loop's), which is what keeps them matched."""

    rank: int = 0
    size: int = 1
    local_size: int = 1  # ranks on this host: they share its RAM, cores and disks
    local_rank: int = 0
    owned: bool = False  # this object initialized the process group: close() destroys it

    @classmethod
    def from_env(cls) -> "Ranks":
        """The job torchrun describes in the environment (WORLD_SIZE, RANK, LOCAL_RANK, ...); one rank without it:
        its process group (gloo for host tensors, NCCL for CUDA ones where CUDA is; TIERTRAIN_DIST_BACKEND
        replaces that choice: "gloo" runs several ranks on one GPU, for tests), and its GPU made current."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size <= 1:
            return cls()
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:  # a WORLD_SIZE left in the shell, not a rank of a job
            raise ConfigError(
                f"WORLD_SIZE={size} is set but {', '.join(missing)} not: this process is no rank of a job; unset "
                "WORLD_SIZE, or start the ranks with --gpus N or torchrun"
            )
        follow_launcher()
        dist = _dist()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        owned = not dist.is_initialized()
        if owned:
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(local_rank % torch.cuda.device_count())
            backend = os.environ.get("TIERTRAIN_DIST_BACKEND") or ("cpu:gloo,cuda:nccl" if cuda else "gloo")
            dist.init_process_group(backend)
        return cls(
            dist.get_rank(),
            dist.get_world_size(),
            int(os.environ.get("LOCAL_WORLD_SIZE", size)),
            local_rank,
            owned,
        )

    @property
    def first(self) -> bool:
        """Rank 0: the one that logs, writes metrics and the run's files."""
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """The rank's own GPU (LOCAL_RANK), or the CPU."""
        if device.type == "cuda" and self.size > 1:
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return device

    def check_batch(self, batch: int, micro: int | None) -> None:
        if batch % self.size:
            raise ConfigError(
                f"train.batch_size {batch} does not split over {self.size} ranks: make it a multiple "
                f"of {self.size}"
            )
        if micro and (batch // self.size) % micro:
            raise ConfigError(
                f"train.micro_batch_size {micro} does not divide a rank's {batch // self.size} rows "
                f'of the batch: make it a divisor of {batch // self.size}, or "auto"'
            )

    def rows(self, batch: int) -> slice:
        """This rank's rows of a batch of `batch`: the r-th contiguous block of batch / N rows."""
        n = batch // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    # ---- collectives (each a no-op for one rank) ---------------------------------------------------
    def all_gather(self, out: torch.Tensor, start: int, numel: int) -> None:
        """`out` (every rank's part, in rank order) from each rank's out[start:start + numel], in place; on the
        current stream."""
        if self.size > 1:
            _gather(out, out[start : start + numel])

    def reduce_scatter(self, t: torch.Tensor, start: int, numel: int) -> torch.Tensor:
        """t[start:start + numel] becomes the sum over the ranks of theirs (in place); the rest of `t` is left
        undefined. Returns that part."""
        part = t[start : start + numel]
        if self.size > 1:
            dist = _dist()  # renamed like all_gather_into_tensor
            (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(part, t)
        return part

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            _dist().all_reduce(t)
        return t

    def host_gather(self, part: torch.Tensor, whole: torch.Tensor) -> None:
        """Every rank's equal-sized host `part`, in rank order, into `whole` (on every rank)."""
        if self.size == 1:
            whole.copy_(part)
        else:
            _gather(whole, part)

    def host_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of (as many) integers, in rank order."""
        t = torch.tensor(values, dtype=torch.int64)
        if self.size == 1:
            return [values]
        out = torch.zeros(self.size * len(values), dtype=torch.int64)
        _gather(out, t)
        return [r.tolist() for r in out.view(self.size, len(values))]

    @contextmanager
    def together(self, *catch: type[BaseException]) -> Iterator[Together]:
        """A block every rank runs, then learns together whether any failed: an exception of the `catch` types
        in it is kept (Together.error), others pass through at once; on leaving, Together.first is the lowest
        rank that failed (None: none), the same on every rank."""
        agreed = Together()
        try:
            yield agreed
        except catch as e:
            agreed.error = e
        # a rank stopping for another's failure (learned in a block nested inside) fails behind every rank that
        # failed itself: that one's words are the job's
        elsewhere = isinstance(agreed.error, ElsewhereError)
        agreed.first = self.first_failed(agreed.error is not None, behind=elsewhere)
        if agreed.first is not None and self.size > 1:
            agreed.alike = self._alike(None if elsewhere else agreed.error)

    def any_failed(self, failed: bool) -> bool:
        """Whether some rank failed (each says whether it did): every rank learns it together."""
        return self.first_failed(failed) is not None

    def first_failed(self, failed: bool, behind: bool = False) -> int | None:
        """The lowest rank that failed (each says whether it did), the same on every rank; None: none did. A rank
        `behind` counts after every rank that failed of itself (the lowest of those is first), as itself where none
        did."""
        if self.size == 1:
            return 0 if failed else None
        n = self.size
        t = torch.tensor([(n + self.rank if behind else self.rank) if failed else 2 * n], dtype=torch.int64)
        _dist().all_reduce(t, op=_dist().ReduceOp.MIN)
        return None if t.item() == 2 * n else int(t.item()) % n

    def _alike(self, error: BaseException | None) -> bool:
        """Whether every rank holds an error of the same class and words (`error`: this rank's own, or None)."""
        v = -1 if error is None else zlib.crc32(f"{type(error).__name__}: {error}".encode())
        t = torch.tensor([v, -v], dtype=torch.int64)
        _dist().all_reduce(t, op=_dist().ReduceOp.MIN)  # the least and (negated) the greatest
        return int(t[0]) >= 0 and int(t[0]) == -int(t[1])

    def share(self, text: str) -> str:
        """Rank 0's `text` (up to 4 KiB of UTF-8), on every rank."""
        if self.size == 1:
            return text
        t = torch.zeros(4096, dtype=torch.uint8)
        raw = text.encode()[:4096] if self.first else b""
        t[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else t[:0]
        _dist().broadcast(t, 0)
        return bytes(t.numpy()).rstrip(b"\0").decode()

    def barrier(self) -> None:
        if self.size > 1:
            _dist().all_reduce(torch.zeros(1))  # on the host (gloo): NCCL's barrier would want a device

    def close(self) -> None:
        if self.owned:
            _dist().destroy_process_group()
            self.owned = False
