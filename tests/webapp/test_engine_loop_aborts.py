"""A worker's engine loop reports every client's abort with the prompt tokens the engine had computed, which the
worker charges to the tenant's share (webapp.serving.ledger): also the aborts that arrive after the loop ended."""
from __future__ import annotations

import threading
import time

import pytest

from inference import SamplingParams
from inference.engine.arg_utils import EngineArgs
from inference.engine.llm_engine import LLMEngine
from webapp.serving.engine_loop import EngineLoop, EngineRequest


@pytest.mark.timeout(300)
def test_every_abort_is_reported_with_the_prompt_it_computed_even_after_the_loop_ended():
    reports, done = [], threading.Event()

    def on_outputs(outputs, _now):
        if any(o.request_id == "long" for o in outputs):
            done.set()

    loop = EngineLoop(lambda: LLMEngine.from_engine_args(EngineArgs(max_model_len=128, kv_cache_space=0.05)),
                      on_outputs, lambda *args: None, capacity=4, on_aborted=reports.append)
    loop.start_and_wait()
    try:
        assert loop.acquire_slot(timeout=5)
        loop.submit(EngineRequest("long", list(range(100, 140)), SamplingParams(max_tokens=60, ignore_eos=True),
                                  0.0))
        assert done.wait(120), "no output of the request"
        loop.abort(["long", "never-seen"])
        deadline = time.monotonic() + 60
        while not reports and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reports == [{"long": 40, "never-seen": 0}]  # its whole prompt; nothing for one it never held
    finally:
        loop.stop()
        loop.join(30)
    loop.abort(["after-the-end"])
    assert reports[-1] == {"after-the-end": 0}
