"""Several processes through ``torch.distributed``: who does what, and the deterministic reductions.

``torchrun --nproc-per-node N -m dynaquant quantize ...`` starts N processes (ranks) running the same streaming
pipeline (:mod:`dynaquant.pipeline.quantize`); :func:`init_from_env` joins them into one process group (NCCL on
CUDA devices, each rank on ``cuda:LOCAL_RANK``; gloo on the CPU) with a timeout, so a rank that dies or hangs stops
the others with an error instead of a hang. Without torchrun's variables (``WORLD_SIZE`` unset) everything
here is the single process: rank 0 of 1, no collective is called.

The split (the output is byte-identical whatever the number of ranks, on the same kind of device):

- calibration sequences: sequence ``s`` runs on rank ``s % world`` (:meth:`Group.owns`); each sequence's statistics
  are a partial sum of its own, and the partial sums are added in sequence order on every rank
  (:meth:`Group.fold`): the single process adds the same partial sums in the same order;
- tensors (error measurement, GPTQ, encoding): by a deterministic balance of their cost (:meth:`Group.assign`), each
  result computed whole on one rank (a tensor's result does not depend on which others a rank computes) and
  shared (:meth:`Group.gather`) or left in the work folder, where rank 0 reads it to write the output.

Memory: a fold holds this rank's partial sum and the one being received beside the accumulator (on CUDA the host
waits for each round, so no more are allocated).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

DEFAULT_TIMEOUT_S = 1800.0  # a collective waits this long for the other ranks (DYNAQUANT_DIST_TIMEOUT: seconds)


@dataclass
class Group:
    """This process's place in the run: ``rank`` of ``world`` (0 of 1 without torch.distributed).

    Attributes:
        rank, world: this process's rank and the number of ranks.
        device: where collectives move tensors (``cuda:LOCAL_RANK`` with NCCL, else ``cpu``).
    """

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    joined: bool = False  # in a torch.distributed process group (torchrun; also with one rank)

    @property
    def main(self) -> bool:
        """True on rank 0, which writes the outputs."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """True in a process group (collectives run; torchrun with one rank too, so that one GPU runs NCCL's path)."""
        return self.joined

    def owns(self, s: int) -> bool:
        """Whether calibration sequence ``s`` runs on this rank (``s % world``)."""
        return s % self.world == self.rank

    def assign(self, costs: Sequence[float]) -> list[int]:
        """The rank of each item: largest cost first (ties: the earlier item), each to the rank with the least cost so
        far (ties: the lower rank), the longest-processing-time rule; the same on every rank."""
        load = [0.0] * self.world
        out = [0] * len(costs)
        for i in sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i)):
            r = min(range(self.world), key=lambda k: (load[k], k))
            load[r] += float(costs[i])
            out[i] = r
        return out

    def mine(self, costs: Sequence[float]) -> list[int]:
        """Indices of the items :meth:`assign` gives this rank."""
        return [i for i, r in enumerate(self.assign(costs)) if r == self.rank]

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable; tensors go through the CPU), in rank order, on every rank."""
        if not self.active:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, _to_cpu(obj))
        return out

    def _pickled(self, obj, src: int):
        """Rank ``src``'s picklable ``obj`` (no tensors) on every rank."""
        if not self.active:
            return obj
        box = [obj if self.rank == src else None]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def fold(self, n: int, run: Callable[[int], object], merge: Callable[[object], None]) -> None:
        """Partial sums of items ``0 .. n-1`` merged in item order on every rank.

        Item ``s`` runs on its owner (:meth:`owns`): ``run(s)`` returns its partial sum, a nested structure of dicts,
        lists, dataclasses, numbers and tensors (or None: nothing to add). Items go in rounds of ``world``, one per
        rank; after each round every rank calls ``merge(part)`` for the round's items in order, each partial sum
        sent from its owner (:meth:`share`). With one rank: ``merge(run(s))`` for each ``s`` in order.
        """
        for s0 in range(0, n, self.world):
            s = s0 + self.rank
            mine = run(s) if s < n else None
            for j in range(min(self.world, n - s0)):
                part = self.share(mine, j)
                if part is not None:
                    merge(part)
            if self.active and self.device.type == "cuda":
                # the host waits for the round: a partial sum sent by NCCL is freed only once the send has run, so
                # a host running ahead would keep many rounds' partial sums allocated
                torch.cuda.synchronize(self.device)

    def share(self, obj, src: int):
        """Rank ``src``'s nested structure on every rank: its layout by pickle, its tensors by ``broadcast`` on
        :attr:`device`, each arriving on the device it left (float and integer tensors bit for bit)."""
        if not self.active:
            return obj
        layout, tensors = (_split(obj) if self.rank == src else (None, None))
        layout = self._pickled(layout, src)
        if layout is None:
            return None
        specs = layout["tensors"]
        out = []
        for k, (shape, dtype, dev) in enumerate(specs):
            t = tensors[k].to(self.device) if self.rank == src else torch.empty(shape, dtype=dtype, device=self.device)
            torch.distributed.broadcast(t, src=src)
            out.append(t if self.rank == src else t.to(dev if torch.device(dev).type == "cpu" else self.device))
        return _join(layout["obj"], out)


_GROUP = Group()


def group() -> Group:
    """The process group this process runs in (:func:`init_from_env`; rank 0 of 1 before or without it)."""
    return _GROUP


def launched() -> bool:
    """True when torchrun (or another launcher) started this process as a rank (``WORLD_SIZE`` set, 1 included)."""
    return "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init_from_env(device: str | torch.device | None = None, timeout: float | None = None) -> Group:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``; one rank too); a no-op returning rank 0 of 1 without them, or when already joined.

    Args:
        device: the run's device: a CUDA device means NCCL, each rank on ``cuda:LOCAL_RANK``; else gloo on the CPU.
        timeout: seconds a collective waits for the others (default ``DYNAQUANT_DIST_TIMEOUT`` or 1800 s): a rank
            that died leaves the others an error after this long (torchrun itself stops them when a rank exits
            with an error).
    Returns:
        The :class:`Group` (also :func:`group`).
    Raises:
        ValueError: CUDA asked for and ``LOCAL_RANK`` names no visible GPU.
    """
    global _GROUP
    if not launched():
        return _GROUP
    if torch.distributed.is_initialized():
        return _GROUP
    cuda = device is not None and torch.device(device).type == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local}: only {torch.cuda.device_count()} CUDA devices are visible; start "
                             "at most that many ranks per node (torchrun --nproc-per-node)")
        torch.cuda.set_device(local)
    timeout = timeout if timeout is not None else timeout_s()
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout),
                                         **({"device_id": dev} if cuda else {}))
    _GROUP = Group(torch.distributed.get_rank(), torch.distributed.get_world_size(), dev, joined=True)
    threads = rank_threads()
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return _GROUP


def rank_threads() -> int:
    """CPU threads for this rank's torch work: ``DYNAQUANT_RANK_THREADS`` if set; else, when torchrun left
    ``OMP_NUM_THREADS=1`` (what it sets for several ranks a node) or nothing, the cores this process may use divided by
    the ranks of this node (``LOCAL_WORLD_SIZE``), at least 1; else torch's own count (``OMP_NUM_THREADS`` given).
    One thread a rank would leave the reading (bfloat16 to float32), the finite checks and the CPU side of the
    encoding on one core of many."""
    if os.environ.get("DYNAQUANT_RANK_THREADS"):
        return max(1, int(os.environ["DYNAQUANT_RANK_THREADS"]))
    if os.environ.get("OMP_NUM_THREADS", "1") != "1":
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def timeout_s() -> float:
    """Seconds a rank waits for the others (``DYNAQUANT_DIST_TIMEOUT``, default :data:`DEFAULT_TIMEOUT_S`)."""
    return float(os.environ.get("DYNAQUANT_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))


def rank_device(device: str | torch.device) -> str:
    """The device this rank computes on: ``cuda:LOCAL_RANK`` for a CUDA run with several ranks, else ``device``."""
    g = group()
    if g.active and torch.device(device).type == "cuda":
        return str(g.device)
    return str(device)


def finish() -> None:
    """Leave the process group (at the end of a run; a no-op without one)."""
    global _GROUP
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _GROUP = Group()


def _to_cpu(obj):
    return _walk(obj, lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v)


class _Slot:
    """A tensor's place in a structure sent by :meth:`Group.share`."""

    def __init__(self, k: int):
        self.k = k


def _split(obj) -> tuple[dict, list[torch.Tensor]]:
    """(layout: the structure with each tensor replaced by its slot, and the tensors' shapes, dtypes, devices;
    the tensors in slot order). Whatever cannot be pickled fails on the sender, in ``broadcast_object_list``."""
    tensors: list[torch.Tensor] = []

    def slot(v):
        if not isinstance(v, torch.Tensor):
            return v
        tensors.append(v.detach())
        return _Slot(len(tensors) - 1)

    shell = _walk(obj, slot)
    return {"obj": shell, "tensors": [(tuple(t.shape), t.dtype, str(t.device)) for t in tensors]}, tensors


def _join(shell, tensors: list[torch.Tensor]):
    """The structure :func:`_split` took apart, with ``tensors`` in its slots."""
    return _walk(shell, lambda v: tensors[v.k] if isinstance(v, _Slot) else v)


def _walk(v, leaf):
    """A copy of the nested structure ``v`` (dicts, lists, tuples, dataclasses) with ``leaf`` applied to every other
    value. Module-level and not a recursive closure: a closure calling itself is a reference cycle, and a cycle
    holding the tensors would keep every partial sum allocated until Python's cycle collector happens to run."""
    if isinstance(v, dict):
        return {k: _walk(x, leaf) for k, x in v.items()}
    if isinstance(v, list):
        return [_walk(x, leaf) for x in v]
    if isinstance(v, tuple):
        return tuple(_walk(x, leaf) for x in v)
    if hasattr(v, "__dataclass_fields__") and not isinstance(v, type):
        out = object.__new__(type(v))
        out.__dict__.update({k: _walk(x, leaf) for k, x in v.__dict__.items()})
        return out
    return leaf(v)
