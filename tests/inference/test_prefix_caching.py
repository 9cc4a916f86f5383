"""Automatic prefix caching end to end: same tokens with caching on and off, far fewer prefill
tokens for a shared system prompt, and no corruption while blocks are evicted and rewritten."""
from __future__ import annotations

import random

import pytest

from inference import LLM, SamplingParams

from .conftest import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def system_prompt(smollm2_tokenizer) -> list[int]:
    text = ("You are Tessera, a careful assistant for an engineering team. Answer briefly, cite the "
            "relevant standard when there is one, prefer SI units, and say so when you are unsure. ") * 4
    return smollm2_tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def questions(smollm2_tokenizer) -> list[list[int]]:
    texts = ["What is the boiling point of water?", "Name a prime number above 50.",
             "How long is a marathon?", "What does RAM stand for?", "Why is the sky blue?",
             "What is the speed of light?"]
    return [smollm2_tokenizer.encode(" " + t, add_special_tokens=False) for t in texts]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY, **kwargs) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, **kwargs)
    return [o.outputs[0].token_ids for o in outs]


def _assert_no_leak(llm: LLM) -> None:
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not llm.llm_engine.has_unfinished_requests()


@pytest.mark.timeout(600)
def test_outputs_identical_with_caching_on_and_off(system_prompt, questions):
    prompts = [system_prompt + q for q in questions]
    plain = LLM(max_model_len=512, kv_cache_space=0.2)
    expected = _tokens(plain, prompts)
    cached = LLM(max_model_len=512, kv_cache_space=0.2, enable_prefix_caching=True, max_num_batched_tokens=256)
    assert _tokens(cached, prompts) == expected  # one batch: later chunks hit the first prompt's blocks
    stats = cached.llm_engine.get_stats()
    assert stats.prefix_cache_hits_total > 0
    outs = cached.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)  # all warm
    assert [o.outputs[0].token_ids for o in outs] == expected
    full_blocks = (len(system_prompt) // 16) * 16
    assert all(o.num_cached_tokens >= full_blocks for o in outs)
    after = cached.llm_engine.get_stats()
    assert after.prefix_cache_hits_total - stats.prefix_cache_hits_total == sum(o.num_cached_tokens for o in outs)
    assert after.prefix_cache_queries_total - stats.prefix_cache_queries_total == sum(map(len, prompts))
    _assert_no_leak(cached)


@pytest.mark.timeout(600)
def test_other_salt_misses_and_same_salt_hits(system_prompt, questions):
    llm = LLM(max_model_len=512, kv_cache_space=0.2, enable_prefix_caching=True)
    prompt = [system_prompt + questions[0]]
    first = llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY, use_tqdm=False, cache_salt="a")[0]
    other = llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY, use_tqdm=False, cache_salt="b")[0]
    same = llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY, use_tqdm=False, cache_salt="a")[0]
    assert (first.num_cached_tokens, other.num_cached_tokens) == (0, 0)
    assert same.num_cached_tokens > 0
    assert first.outputs[0].token_ids == other.outputs[0].token_ids == same.outputs[0].token_ids


@pytest.mark.timeout(900)
def test_tiny_pool_evictions_and_rewrites_never_corrupt_cached_blocks(system_prompt, questions):
    """Rounds of prompts that share prefixes in different ways, on a pool too small to keep them:
    hits, LRU evictions, rewrites of evicted blocks and preemptions interleave; every output must
    equal the no-cache output."""
    rng = random.Random(3)
    short_system = system_prompt[:40]
    pool = [system_prompt + q for q in questions] + [short_system + q for q in questions]
    pool += [q + short_system for q in questions[:3]]  # same tokens at other positions: never a hit
    rounds = [rng.sample(range(len(pool)), 6) for _ in range(3)]
    kwargs = dict(max_model_len=256, num_kv_blocks=24, max_num_batched_tokens=96)
    plain = LLM(**kwargs)
    expected = {i: t for i, t in zip(range(len(pool)), _tokens(plain, pool))}
    cached = LLM(enable_prefix_caching=True, **kwargs)
    for indices in rounds:
        assert _tokens(cached, [pool[i] for i in indices]) == [expected[i] for i in indices]
    kv = cached.llm_engine.kv_cache_manager
    stats = cached.llm_engine.get_stats()
    assert stats.prefix_cache_hits_total > 0 and kv.pool.num_evicted_blocks > 0
    _assert_no_leak(cached)


@pytest.mark.timeout(600)
def test_preempted_request_hits_its_own_blocks(smollm2_tokenizer):
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(40)] for _ in range(3)]  # no shared prefixes
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kwargs = dict(max_model_len=128, num_kv_blocks=10)  # 4 blocks a request at the end, room for 2
    expected = _tokens(LLM(**kwargs), prompts, params)
    cached = LLM(enable_prefix_caching=True, **kwargs)
    assert _tokens(cached, prompts, params) == expected
    stats = cached.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0


@pytest.mark.timeout(600)
def test_shared_system_prompt_computes_90_percent_fewer_prefill_tokens(tmp_path, smollm2_tokenizer):
    folder = make_tiny_model("llama", tmp_path / "tiny", smollm2_tokenizer, max_position_embeddings=2048)
    rng = random.Random(0)
    system = [rng.randrange(100, 40000) for _ in range(1000)]
    prompts = [system + [rng.randrange(100, 40000) for _ in range(rng.randint(5, 20))] for _ in range(100)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    computed, outputs = {}, {}
    for caching in (False, True):
        llm = LLM(model=str(folder), max_model_len=1100, kv_cache_space=0.2, enable_prefix_caching=caching)
        outputs[caching] = _tokens(llm, prompts, params)
        stats = llm.llm_engine.get_stats()
        computed[caching] = stats.prompt_tokens_computed_total
        assert stats.prompt_tokens_total == sum(map(len, prompts))
    assert computed[False] == sum(map(len, prompts))
    assert computed[True] <= 0.1 * computed[False], computed
    assert outputs[True] == outputs[False]


@pytest.mark.timeout(600)
def test_stop_strings_with_prefix_caching(system_prompt, questions):
    """A stop string ends a request after its next step was already launched; that step's blocks
    must not be registered in the cache once the request's blocks are freed (it crashed the engine)."""
    prompts = [system_prompt + q for q in questions[:3]]
    llm = LLM(max_model_len=512, kv_cache_space=0.2, enable_prefix_caching=True)
    free_run = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)
    for prompt, out in zip(prompts, free_run):
        text = out.outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        assert stop.strip(), text
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
        stopped = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
        assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
        assert stopped.text == text[:text.index(stop)]
    _assert_no_leak(llm)
    assert _tokens(llm, prompts[:1]) == _tokens(LLM(max_model_len=512, kv_cache_space=0.2), prompts[:1])
