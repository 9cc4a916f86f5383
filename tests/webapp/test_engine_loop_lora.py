"""A worker's engine loop and a registered LoRA adapter that no longer loads: its requests get 503 (the
operator's fault, not the client's) with the reason, and no server path, in the message; other requests go on."""
from __future__ import annotations

import shutil
import threading

import pytest

from inference import SamplingParams
from inference.engine.arg_utils import EngineArgs
from inference.engine.llm_engine import LLMEngine
from webapp.serving.engine_loop import EngineLoop, EngineRequest


@pytest.mark.timeout(300)
def test_a_registered_adapter_whose_folder_is_gone_is_a_503_without_its_path(tmp_path):
    rejected, finished = [], threading.Event()

    def on_outputs(outputs, _now):
        if any(o.finished for o in outputs):
            finished.set()

    loop = EngineLoop(lambda: LLMEngine.from_engine_args(EngineArgs(enable_lora=True, max_model_len=128,
                                                                    kv_cache_space=0.05)),
                      on_outputs, lambda *args: rejected.append(args), capacity=4)
    loop.start_and_wait()
    try:
        folder = tmp_path / "gone"
        folder.mkdir()
        shutil.rmtree(folder)
        params = SamplingParams(max_tokens=2, temperature=0)
        for rid, lora in (("adapter", ("sql", str(folder))), ("base", (None, None))):
            assert loop.acquire_slot(timeout=5)
            loop.submit(EngineRequest(rid, [1, 2, 3], params, 0.0, lora_name=lora[0], lora_path=lora[1]))
        assert finished.wait(120), "the base model's request did not finish"
        [(rid, status, message, param)] = rejected
        assert (rid, status, param) == ("adapter", 503, None)
        assert "'sql'" in message and "no such folder" in message and str(tmp_path) not in message
    finally:
        loop.stop()
        loop.join(timeout=30)
