"""The scheduler with LoRA, without a model: at most max_loras adapters per step, a request whose adapter
would exceed it waits while those behind it run, and the step's adapters keep or take device slots."""
from __future__ import annotations

import pytest

from inference.config import SchedulerConfig
from inference.kv_cache import KVCacheManager
from inference.lora.checkpoint import LoRAAdapter
from inference.lora.request import LoRARequest
from inference.lora.slots import LoRASlots
from inference.request import Request, RequestStatus
from inference.sampling_params import SamplingParams
from inference.sched.scheduler import Scheduler

from .model_free import update


def _adapter(name: str, lora_id: int) -> LoRAAdapter:
    return LoRAAdapter(LoRARequest(name, lora_id, f"/adapters/{name}"), 8, f"key-{name}", {})


def _request(request_id: str, adapter: LoRAAdapter | None, priority: int = 0) -> Request:
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    return Request(request_id, request_id, 0, [5, 6, 7], params, 3, priority=priority, lora_adapter=adapter)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_over_max_loras_waits_and_the_ones_behind_it_run(policy):
    a, b, c = _adapter("a", 1), _adapter("b", 2), _adapter("c", 3)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                          scheduling_policy=policy),
                          KVCacheManager(32, 4, enable_prefix_caching=True), LoRASlots(2))
    requests = [_request("a1", a), _request("b1", b), _request("c1", c), _request("base", None), _request("a2", a),
                _request("c2", c)]
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert [item.request.request_id for item in out.scheduled] == ["a1", "b1", "base", "a2"]
    assert out.lora_slots == {"key-a": 0, "key-b": 1}
    assert [(slot, adapter.lora_name) for slot, adapter in out.lora_loads] == [(0, "a"), (1, "b")]
    assert {r.request_id for r in scheduler.waiting} == {"c1", "c2"}
    while scheduler.running:  # a and b run to the end; c waits for a slot all along
        assert scheduler.lora_slots.active_keys(scheduler.running) <= {"key-a", "key-b"}
        out = scheduler.schedule()
        assert not out.lora_loads
        update(scheduler, out)
    out = scheduler.schedule()
    assert [item.request.request_id for item in out.scheduled] == ["c1", "c2"]
    assert out.lora_slots == {"key-c": 0} and [slot for slot, _ in out.lora_loads] == [0]  # a's slot, the LRU
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests[:2] + requests[3:5])


def test_slots_keep_resident_adapters_and_replace_the_least_recently_used():
    a, b, c = (_adapter(n, i) for i, n in enumerate("abc", 1))
    slots = LoRASlots(2)
    r = {name: _request(name, adapter) for name, adapter in zip("abc", (a, b, c))}
    assert slots.assign([r["a"], r["b"]])[1] == [(0, a), (1, b)]
    assert slots.assign([r["b"]]) == ({"key-b": 1}, [])
    assert slots.assign([r["c"], r["b"]]) == ({"key-b": 1, "key-c": 0}, [(0, c)])  # a was the LRU
    with pytest.raises(RuntimeError, match="max_loras=2"):
        slots.assign(list(r.values()))
