"""Tenant GPU shares in the real engine (SmolLM2 on CPU): two flooding tenants split the
computed tokens 30/70, shares change on a running engine, and shares never change what a
request generates."""
from __future__ import annotations

import pytest

from inference import SamplingParams
from inference.engine import EngineArgs, LLMEngine
from inference.errors import InvalidRequestError

@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                                                 kv_cache_space=0.1))


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids if out.outputs else [])
    return tokens


def test_two_flooding_tenants_split_30_70(engine):
    engine.set_tenant_shares({"team1": 30, "team2": 70})
    fair = engine.scheduler.fair_share
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    prompt = list(range(100, 116))  # 16 tokens
    counter = 0
    start = dict(fair.served_tokens)
    for _ in range(40):
        waiting = {"team1": 0, "team2": 0}
        for r in engine.scheduler.waiting:
            waiting[r.tenant_id] += 1
        for tenant, n in waiting.items():
            for _ in range(10 - n):  # both always backlogged beyond max_num_seqs
                engine.add_request(f"{tenant}-{counter}", prompt, params, tenant_id=tenant)
                counter += 1
        engine.step()
    served = {t: fair.served_tokens.get(t, 0) - start.get(t, 0) for t in ("team1", "team2")}
    engine.abort_request([r.parent_id for r in [*engine.scheduler.running, *engine.scheduler.waiting]], report=False)
    share = served["team1"] / sum(served.values())
    assert abs(share - 0.30) <= 0.05, served


def test_shares_change_on_a_running_engine(engine):
    engine.set_tenant_shares({"a": 50, "b": 50})
    fair = engine.scheduler.fair_share
    engine.set_tenant_shares({"a": 90, "b": 10})
    assert engine.scheduler.fair_share is fair and fair.weight("a") == 90 and fair.weight("b") == 10
    with pytest.raises(InvalidRequestError) as error:
        engine.set_tenant_shares({"a": -5})
    assert error.value.param == "shares"


def test_shares_do_not_change_the_generated_tokens(engine):
    params = SamplingParams(max_tokens=10, temperature=0)
    prompts = ["The capital of France is", "List three colors:", "def add(a, b):", "Once upon a time"]
    engine.scheduler.fair_share = None
    for i, p in enumerate(prompts):
        engine.add_request(f"plain-{i}", p, params)
    plain = _drain(engine)
    engine.set_tenant_shares({"x": 10, "y": 90})
    for i, p in enumerate(prompts):
        engine.add_request(f"shared-{i}", p, params, tenant_id="xy"[i % 2])
    shared = _drain(engine)
    assert [plain[f"plain-{i}"] for i in range(4)] == [shared[f"shared-{i}"] for i in range(4)]
    assert all(plain.values())


def test_unstarted_requests_are_the_waiting_ones_nothing_was_computed_for(engine):
    """What a worker may take out of its backlog and give to another engine: requests the
    scheduler has not started, in arrival order, with their tenants."""
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    ids = [f"unstarted-{i}" for i in range(10)]
    for i, rid in enumerate(ids):  # 10 x 16 prompt tokens: more than one step's 64-token budget
        engine.add_request(rid, list(range(200 + i, 216 + i)), params, tenant_id="solo")
    assert engine.unstarted_requests() == [(rid, "solo") for rid in ids]
    engine.step()
    unstarted = [rid for rid, _ in engine.unstarted_requests()]
    assert 0 < len(unstarted) < len(ids) and unstarted == ids[len(ids) - len(unstarted):]
    engine.abort_request(unstarted[-1], report=False)  # taken out unstarted: no output, no blocks held
    assert [rid for rid, _ in engine.unstarted_requests()] == unstarted[:-1]
    tokens = _drain(engine)
    assert unstarted[-1] not in tokens and all(len(tokens[rid]) == 4 for rid in ids[:-1])
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
