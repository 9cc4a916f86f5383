"""Rank 0's handle on the other tensor-parallel ranks: spawning them, sending them each step,
noticing when one fails, and ending them.

Why a pipe per rank for the steps: a step's description (``StepPlan``: block operations and the
flattened host arrays of the batch, a few KB) is pickled once on rank 0 and written to each
rank's pipe, about as cheap as one gloo broadcast and without the size handshake a broadcast of
variable-length bytes needs; the device tensors are then built on each rank from its own copy
(no collective before the forward pass). A pipe also tells an idle rank that rank 0 died (EOF),
and carries a failing rank's traceback back to rank 0.
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
import time
import weakref
from multiprocessing.connection import wait as wait_for_connections

import torch
import torch.multiprocessing as mp

from ..errors import InvalidRequestError, TesseraError
from .process_group import open_store
from .rank_worker import rank_main

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # seconds for the ranks to import torch and build their model
REPORT_WAIT_S = 2.0  # seconds rank 0 waits for a failed rank's report
STOP_WAIT_S = 5.0  # seconds a rank gets to exit after ``close`` before it is terminated


class TensorParallelError(TesseraError, RuntimeError):
    """A tensor-parallel rank failed (raised, was killed, or exited); the engine cannot continue.

    Attributes:
        rank: the failed rank, or None when rank 0 itself failed.
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is not responding"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _end_processes(processes: list, connections: list, group=None, before_shutdown=None) -> None:
    """Ask every rank to stop, shut rank 0's ``group`` down while the ranks do theirs, then terminate
    and kill what is left (also run by the finalizer when the engine is garbage-collected, so it must
    not refer to the ``RankProcesses`` object). ``before_shutdown`` (rank 0's CUDA graph release)
    runs first."""
    if before_shutdown is not None:
        before_shutdown()
    for conn in connections:
        try:
            conn.send_bytes(b"")
        except (OSError, ValueError):
            pass
    if group is not None:
        group.shutdown()
    deadline = time.monotonic() + STOP_WAIT_S
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
    for conn in connections:
        conn.close()


class RankProcesses:
    """Spawns ranks ``1..world_size-1`` (``torch.multiprocessing``'s spawn context) and talks to them.

    Args:
        config: the engine's ``EngineConfig`` (sent to every rank).
        num_kv_blocks: KV pool override, the same for every rank.
        num_threads: torch CPU threads per rank.
    The ranks are ended by :meth:`close`, when this object is garbage-collected, at interpreter
    exit (daemon processes), and on their own when this process dies.
    """

    def __init__(self, config, num_kv_blocks: int | None, num_threads: int) -> None:
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        if main_file is not None and os.path.basename(main_file) == "<stdin>":
            raise InvalidRequestError("tensor_parallel_size > 1 cannot run from a script read on standard input "
                                      "(python -): the rank processes import the main script again. Save it to "
                                      "a file, with the LLM created under if __name__ == '__main__':.",
                                      param="tensor_parallel_size")
        self.world_size = config.tensor_parallel_size
        self.store = open_store(self.world_size)
        ctx = mp.get_context("spawn")
        self.processes, self.connections = [], []
        for rank in range(1, self.world_size):
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=rank_main, name=f"tessera-tp-rank{rank}", daemon=True,
                               args=(config, rank, self.world_size, self.store.port, theirs, num_kv_blocks,
                                     num_threads, os.getpid()))
            proc.start()
            theirs.close()
            self.processes.append(proc)
            self.connections.append(ours)
        self._finalizer = weakref.finalize(self, _end_processes, self.processes, self.connections)
        self.failed: TensorParallelError | None = None

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..world_size-1."""
        return [p.pid for p in self.processes]

    def wait_for(self, state: str) -> None:
        """Wait until every rank reports ``state``: ``"started"`` (imports done, about to join the
        group: rank 0 joins only then, so that a rank dying at start-up is not a wait for the
        group's timeout) or ``"ready"`` (model and KV cache built; rank 0's too by then).

        Raises:
            TensorParallelError: a rank failed or exited first.
        """
        pending = dict(zip(self.connections, range(1, self.world_size)))
        deadline = time.monotonic() + START_TIMEOUT_S
        while pending:
            for conn in wait_for_connections(list(pending), timeout=1.0):
                rank = pending.pop(conn)
                kind, detail = self._receive(rank)
                if kind != state:
                    raise self._fail(rank, detail)
            for conn, rank in pending.items():
                proc = self.processes[rank - 1]
                if not proc.is_alive() and not conn.poll():
                    raise self._fail(rank, f"the process {_describe_exit(proc.exitcode)} while starting")
            if time.monotonic() > deadline:
                raise self._fail(min(pending.values()), f"not {state} after {START_TIMEOUT_S:.0f} s")

    def send(self, plan) -> None:
        """Send one step's ``StepPlan`` to every rank (pickled once).

        Raises:
            TensorParallelError: a rank is gone.
        """
        if self.failed is not None:
            raise self.failed
        if not self._finalizer.alive:
            raise TensorParallelError("the engine is closed: its tensor-parallel ranks have ended")
        payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.connections:
            try:
                conn.send_bytes(payload)
            except (OSError, ValueError) as error:
                raise self.failure(error) from error

    def failure(self, error: BaseException) -> TensorParallelError:
        """The error to raise after rank 0 failed with ``error`` during a step or start-up: names the rank
        that failed first (its report, or how its process ended) and ends every rank.

        Rank 0's own ``error`` is usually a consequence (a collective whose peer left); when no
        other rank failed it is the cause.
        """
        if self.failed is not None:
            return self.failed
        deadline = time.monotonic() + REPORT_WAIT_S
        while self._finalizer.alive and time.monotonic() < deadline:
            ranks = list(enumerate(zip(self.connections, self.processes), start=1))
            # A rank that died without a report (killed) comes first: its peers' errors are the
            # collectives it broke, and they may report before its death is seen.
            for rank, (conn, proc) in ranks:
                if not proc.is_alive() and not conn.poll():
                    return self._fail(rank, f"the process {_describe_exit(proc.exitcode)}")
            for rank, (conn, proc) in ranks:
                if conn.poll():
                    kind, detail = self._receive(rank)
                    if kind == "error":
                        return self._fail(rank, detail)
            time.sleep(0.05)
        self.failed = TensorParallelError(f"tensor-parallel rank 0 failed: {error!r}", rank=0)
        self.close()
        return self.failed

    def _receive(self, rank: int) -> tuple[str, str | None]:
        try:
            return self.connections[rank - 1].recv()
        except (EOFError, OSError):
            proc = self.processes[rank - 1]
            proc.join(1.0)
            return "error", f"the process {_describe_exit(proc.exitcode)}"

    def _fail(self, rank: int, detail: str | None) -> TensorParallelError:
        last = (detail or "").strip().splitlines()
        summary = last[-1] if last else "unknown error"
        logger.error("tensor-parallel rank %d failed:\n%s", rank, detail)
        self.failed = TensorParallelError(f"tensor-parallel rank {rank} failed: {summary}", rank=rank)
        self.close()
        return self.failed

    def set_group(self, group, before_shutdown=None) -> None:
        """Rank 0's ``TensorParallelGroup``: from now on, ending the ranks also shuts it down, at the same
        time as theirs, after calling ``before_shutdown()`` (which must not refer to this object or to
        its owner, or the finalizer would keep them alive)."""
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _end_processes, self.processes, self.connections, group,
                                           before_shutdown)

    def close(self) -> None:
        """End every rank (a stop message, then terminate/kill after ``STOP_WAIT_S``); idempotent."""
        self._finalizer()


def threads_per_rank(world_size: int, device: str) -> int:
    """torch CPU threads for each rank: on CPU the cores this process may use, divided among the
    ranks (rank 0 included); on GPU the host work of a rank needs few threads."""
    if device.startswith("cuda"):
        return max(1, min(4, torch.get_num_threads()))
    return max(1, torch.get_num_threads() // world_size)
