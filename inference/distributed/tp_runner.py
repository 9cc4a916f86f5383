"""Rank 0's model runner under tensor parallelism: the ``ModelRunner`` of rank 0 that also drives
the other ranks (every step's plan goes to them before rank 0 runs it)."""
from __future__ import annotations

import logging

import torch

from ..config import EngineConfig
from ..sched.scheduler_output import SchedulerOutput
from ..runner.model_runner import ModelRunner
from ..runner.step_handle import StepHandle
from .process_group import join_group
from .rank_processes import RankProcesses, TensorParallelError, threads_per_rank

logger = logging.getLogger(__name__)


class TensorParallelRunner(ModelRunner):
    """Spawns ranks 1..tp-1, builds rank 0's part of the model beside them, and runs every step on all.

    The engine uses it like a ``ModelRunner`` (same attributes; ``num_blocks`` is the smallest count
    every rank can hold). Block copies and swaps travel in the plan, so every rank applies them to
    its own KV cache. On CPU the process's torch threads are divided among the ranks (restored by
    :meth:`close`).

    Raises:
        TensorParallelError: a rank failed while starting or during a step (naming the rank); the
            other ranks are ended, and so is every later call.
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int | None = None) -> None:
        world_size = config.tensor_parallel_size
        num_threads = threads_per_rank(world_size, config.device)
        self._threads_before = torch.get_num_threads() if config.device == "cpu" else None
        self.ranks = RankProcesses(config, num_kv_blocks, num_threads)
        try:
            if self._threads_before is not None:
                torch.set_num_threads(num_threads)
            self.ranks.wait_for("started")
            group = join_group(0, world_size, config.device, store=self.ranks.store)
            self.ranks.set_group(group)
            super().__init__(config, num_kv_blocks, tp=group)
            if self.graph_runner is not None:  # graphs go before the communicators, however the engine ends
                self.ranks.set_group(group, self.graph_runner.release)
            self.ranks.wait_for("ready")
        except TensorParallelError:
            self.close()
            raise
        except Exception as error:
            failure = self.ranks.failure(error)  # names the failed rank, ends the ranks
            self.close()
            raise failure from error
        logger.info("tensor parallel: %d ranks (rank processes %s), %d torch threads each",
                    world_size, self.ranks.pids, num_threads)

    def execute_async(self, sched_out: SchedulerOutput, input_ids: torch.Tensor | None = None,
                      prev: StepHandle | None = None) -> StepHandle:
        input_ids = self._ahead_input_ids(sched_out, input_ids)
        plan = self.plan(sched_out, ahead=input_ids is not None)  # ahead: rank 0 broadcasts the input ids
        self.ranks.send(plan)
        try:
            return self.run(plan, sched_out, input_ids, prev)
        except Exception as error:
            raise self.ranks.failure(error) from error

    def apply_block_ops(self, sched_out: SchedulerOutput) -> None:
        plan = self.plan(sched_out, with_batch=False)
        self.ranks.send(plan)
        self.run(plan)

    def close(self) -> None:
        """End the rank processes (idempotent); later steps raise ``TensorParallelError``."""
        self.ranks.close()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
