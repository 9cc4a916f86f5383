"""A launched single step's handle: the sampled tokens on their way to host memory, and the ``ModelRunnerOutput``
read back from them (a decode window's handle is ``multi_step.MultiStepHandle``)."""
from __future__ import annotations

import time

import torch

from ..sched.scheduler_output import ModelRunnerOutput


class DeviceTimed:
    """The device time of a launch: from ``start_event`` (recorded by the runner before the launch's first
    kernel) to the handle's event (recorded after its tokens' copy to the host). CUDA only."""

    start_event: "torch.cuda.Event | None" = None
    _event: "torch.cuda.Event | None" = None
    waited_at: float | None = None  # when the host first waited for the tokens (time.perf_counter() s)

    @staticmethod
    def _done_event() -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @property
    def device_seconds(self) -> float | None:
        """Seconds the device spent from the launch's start to its tokens' copy; None without both events.
        Call after ``result()`` (the events have completed by then)."""
        if self.start_event is None or self._event is None:
            return None
        return self.start_event.elapsed_time(self._event) / 1000


class StepHandle(DeviceTimed):
    """A launched step: its sampled tokens are on their way to host memory.

    ``result()`` blocks until the device has produced them (the step's only host synchronisation)
    and returns the ``ModelRunnerOutput``.
    """

    def __init__(self, requests: list, sampled, prompt_logprobs: dict) -> None:
        self._requests = requests
        self._sampled = sampled
        self._prompt_logprobs = prompt_logprobs
        self._result: ModelRunnerOutput | None = None
        self._host_tokens = None
        self._event = None
        if sampled is not None and sampled.token_ids.is_cuda:
            self._host_tokens = torch.empty(sampled.token_ids.shape, dtype=sampled.token_ids.dtype, pin_memory=True)
            self._host_tokens.copy_(sampled.token_ids, non_blocking=True)
            self._event = self._done_event()

    @property
    def device_token_ids(self) -> torch.Tensor | None:
        """The sampled tokens ``[N]`` int64 where they were computed (no wait)."""
        return None if self._sampled is None else self._sampled.token_ids

    @property
    def requests(self) -> list:
        """The requests that sample in this step, in the order of ``result().token_ids``."""
        return self._requests

    def result(self) -> ModelRunnerOutput:
        """The step's tokens on the host (waits for the device the first time; the same object after)."""
        if self._result is None:
            self.waited_at = time.perf_counter()
            self._result = self._fetch()
        return self._result

    def _fetch(self) -> ModelRunnerOutput:
        if self._sampled is None:
            token_ids: list[int] = []
            logprobs: list = []
        else:
            if self._event is not None:
                self._event.synchronize()
                token_ids = self._host_tokens.tolist()
            else:
                token_ids = self._sampled.token_ids.tolist()
            logprobs = _split_logprobs(self._requests, self._sampled)
        prompt = {rid: tuple(t.cpu() for t in data) for rid, data in self._prompt_logprobs.items()}
        return ModelRunnerOutput(token_ids, logprobs, prompt)


def _split_logprobs(requests, sampled) -> list:
    if sampled.logprobs is None:
        return [None] * len(requests)
    ids, values, ranks = sampled.logprob_token_ids.cpu(), sampled.logprobs.cpu(), sampled.sampled_ranks.cpu()
    result = []
    for i, req in enumerate(requests):
        k = req.sampling_params.logprobs
        result.append(None if k is None else (ids[i, :k + 1], values[i, :k + 1], int(ranks[i])))
    return result
