"""A worker that ``serve`` starts in place of a dead one serves what the dead one served: the model an admin
loaded (not the one on ``serve``'s command line), or none after an unload. Real workers, real Redis."""
from __future__ import annotations

import json
import time

from tests.webapp.serving_stack import MODEL, Stack
from webapp.serving.commands import LOAD, UNLOAD, ModelCommand, send_command
from webapp.serving.model_spec import ModelSpec
from webapp.transport.keys import slot_key

LOADED = "smol-loaded"  # the packaged model under another name and context length, as an admin loads it


def _wait(condition, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.25)
    return value


def _ready(s: Stack, model: str | None) -> dict | None:
    """The live worker's heartbeat once it serves ``model`` (None: once it serves nothing)."""
    for info in s.worker_infos():
        if model is None and not info.get("model") and info.get("state") in ("idle", "failed"):
            return info
        if model is not None and info.get("model") == model and info.get("state") == "ready":
            return info
    return None


def _restart(s: Stack) -> None:
    """As ``serve`` does when a worker dies: a new worker with the same environment (the same slot)."""
    s.workers[-1].kill()
    _wait(lambda: not s.worker_infos(), 30)  # its heartbeat expired
    s.add_worker()


def test_a_restarted_worker_serves_what_its_slot_served(tmp_path):
    s = Stack(tmp_path, TESSERA_WORKER_SLOT="test-host-1-0")
    try:
        worker = _wait(lambda: _ready(s, MODEL))
        spec = ModelSpec(name=LOADED, source=MODEL, max_model_len=512)
        send_command(s.redis, worker["id"], ModelCommand(LOAD, spec))
        _wait(lambda: _ready(s, LOADED))
        assert json.loads(s.redis.get(slot_key("test-host-1-0")))["spec"] == spec.to_json()

        _restart(s)
        restarted = _wait(lambda: _ready(s, LOADED))
        assert restarted["id"] != worker["id"]
        reply = s.openai().completions.create(model=LOADED, prompt="Hello", max_tokens=2)
        assert reply.model == LOADED and reply.usage.completion_tokens == 2

        send_command(s.redis, restarted["id"], ModelCommand(UNLOAD))
        _wait(lambda: _ready(s, None))
        _restart(s)
        log = s.logs_dir / f"worker{len(s.workers) - 1}.log"
        _wait(lambda: log.exists() and " started (" in log.read_text())  # start() done: it loaded what it would
        idle = _wait(lambda: _ready(s, None))
        assert "started (no model" in log.read_text() and not idle.get("loading")
        assert json.loads(s.redis.get(slot_key("test-host-1-0")))["spec"] is None
    finally:
        s.stop()


def test_a_recorded_model_that_no_longer_loads_leaves_the_worker_up_and_idle(tmp_path):
    """Not a crash loop: the worker that cannot load its slot's model stays up, failed, with the reason."""
    s = Stack(tmp_path, num_workers=0, TESSERA_WORKER_SLOT="test-host-2-0")
    try:
        gone = ModelSpec(name="gone", source=str(tmp_path / "deleted.gguf"))
        s.redis.set(slot_key("test-host-2-0"), json.dumps({"spec": gone.to_json()}))
        worker = s.add_worker()
        info = _wait(lambda: [i for i in s.worker_infos() if i.get("state") == "failed"], 120)[0]
        assert "deleted.gguf" in info.get("error", "") and worker.alive()
        assert json.loads(s.redis.get(slot_key("test-host-2-0")))["spec"] is None
    finally:
        s.stop()


def test_a_model_whose_workers_keep_dying_is_resumed_twice_then_the_flags_win(tmp_path):
    """No restart loop when the resumed model kills its worker each time: after MAX_RESUMES resumes within
    RESUME_WINDOW, the next worker in the slot starts with its flags' model."""
    s = Stack(tmp_path, num_workers=0, TESSERA_WORKER_SLOT="test-host-3-0")
    try:
        spec = ModelSpec(name=LOADED, source=MODEL, max_model_len=512)
        now = time.time()
        s.redis.set(slot_key("test-host-3-0"),
                    json.dumps({"spec": spec.to_json(), "resumes": [now - 60, now - 30]}))
        s.add_worker()
        _wait(lambda: _ready(s, MODEL))  # the flags' model, not the record's
        assert json.loads(s.redis.get(slot_key("test-host-3-0")))["spec"]["name"] == MODEL
    finally:
        s.stop()
