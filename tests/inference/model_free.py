"""Driving the real scheduler without a model: the runner output of a step in which every sampling
request samples the same token."""
from __future__ import annotations

from inference.sched.scheduler import Scheduler
from inference.sched.scheduler_output import ModelRunnerOutput, SchedulerOutput, SchedulerUpdate


def same_token_output(out: SchedulerOutput, token_id: int) -> ModelRunnerOutput:
    """``token_id`` for every sampling request of ``out`` (forks included), no logprobs."""
    num_sampled = sum(len(item.sampling_requests) for item in out.scheduled)
    return ModelRunnerOutput([token_id] * num_sampled, [None] * num_sampled)


def update(scheduler: Scheduler, out: SchedulerOutput, token_id: int = 1) -> SchedulerUpdate:
    """``scheduler.update_from_output`` after ``out`` ran and every sampling request sampled ``token_id``."""
    return scheduler.update_from_output(out, same_token_output(out, token_id))
