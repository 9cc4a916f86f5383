"""The tensor-parallel process group of one engine: its rank, its size and its collectives.

Each engine owns its group object (built from a ``TCPStore`` rank 0 opens on a free port)
instead of torch.distributed's process-wide default group, so that one process can hold
several engines (a TP=1 and a TP=3 engine side by side in a test, or one built after another
was closed). NCCL on CUDA devices, gloo on CPU.
"""
from __future__ import annotations

import datetime
import logging
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# How long a collective may wait for a peer. Gloo notices a peer that exited at once (its
# sockets close); a peer that hangs, or NCCL, surfaces after this.
DEFAULT_TIMEOUT_S = 300.0
TEARDOWN_WAIT_S = 10.0  # seconds closing waits for the NCCL communicators to be aborted

logger = logging.getLogger(__name__)


@dataclass
class TensorParallelGroup:
    """The ranks of one engine.

    Attributes:
        rank: this process's rank (0 runs the scheduler and samples).
        world_size: ``tensor_parallel_size``.
        pg: the torch process group (None when ``world_size == 1``).
        store: the rendezvous store, which must outlive ``pg``.
    """

    rank: int = 0
    world_size: int = 1
    pg: object | None = None
    store: object | None = field(default=None, repr=False)

    def shutdown(self) -> None:
        """Release this rank's communicators (idempotent; nothing to do for one rank).

        Every rank calls this when the engine closes (rank 0 after sending the ranks their stop
        message, the others on receiving it). The teardown of communicators whose all-reduces live
        in CUDA graphs never returns (pytorch/pytorch#115388; seen on two H200s in every rank), so
        each rank destroys its graphs first (``CudaGraphRunner.release``). The communicators are then
        aborted (``ncclCommAbort``: no collective is pending by then) on a thread that is given up on
        after ``TEARDOWN_WAIT_S`` seconds, so that closing an engine never hangs whatever NCCL does.
        """
        pg, self.pg = self.pg, None
        if pg is None or not hasattr(pg, "abort"):  # one rank, or a torch without abort()
            return
        done = threading.Event()

        def abort() -> None:
            pg.abort()
            done.set()
        threading.Thread(target=abort, name="tessera-tp-teardown", daemon=True).start()
        if not done.wait(TEARDOWN_WAIT_S):
            logger.warning("rank %d: aborting the NCCL communicators did not return within %.0f s; going on",
                           self.rank, TEARDOWN_WAIT_S)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (any shape and dtype); every rank gets the same result."""
        if self.world_size == 1:
            return x
        self.pg.allreduce([x]).wait()
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum of ``x`` over the ranks, in place (any shape and dtype)."""
        if self.world_size == 1:
            return x
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.pg.allreduce([x], opts).wait()
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place (the others pass a tensor of the same shape and dtype)."""
        if self.world_size == 1:
            return x
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([x], opts).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate the ranks' ``x`` ``[N, V_shard]`` along the last dim on rank 0 (``[N, V_shard * tp]``,
        ranks in order); other ranks get None. Every rank must pass the same shape."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            self.pg.gather([parts], [x], dist.GatherOptions()).wait()
            return torch.cat(parts, dim=-1)
        self.pg.gather([], [x], dist.GatherOptions()).wait()
        return None

    def min_over_ranks(self, value: int, device: str) -> int:
        """The smallest ``value`` of all ranks (the KV block count every rank can hold)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([-value], dtype=torch.int64, device=device)
        return -int(self.all_reduce_max(t).item())

    def barrier(self, device: str) -> None:
        self.min_over_ranks(0, device)


def open_store(world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (``store.port``)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_group(rank: int, world_size: int, device: str, store: dist.Store | None = None, port: int | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallelGroup:
    """Join the group (blocks until every rank has joined).

    Args:
        store: rank 0's store (rank 0); the others connect to ``port`` on 127.0.0.1.
        device: ``"cpu"`` (gloo) or ``"cuda:<rank>"`` (NCCL on that GPU).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    prefixed = dist.PrefixStore("tessera-tp", store)
    if device.startswith("cuda"):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    group = TensorParallelGroup(rank, world_size, pg, store)
    group.barrier(device)
    return group
