"""Structured output in the engine (``SamplingParams(structured_outputs=...)``), on the packaged
SmolLM2: every output matches its JSON schema / regex / choice / grammar, checked by a validator
(``jsonschema``, ``re.fullmatch``), alone and mixed with unconstrained requests, with ``n > 1``,
prefix caching, preemption, multi-step windows, tensor parallelism; a cut output is a valid prefix;
bad constraints are refused naming the field; a grammar that compiles slowly holds back only its
own request. Without the bitmask the same prompts give text that does not validate (checked
below), so these tests fail when the mask is off."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from inference import LLM, InvalidRequestError, SamplingParams
from inference.structured_output import StructuredOutputsParams
from inference.structured_output.bitmask import apply_token_bitmask_reference, bitmask_width
from inference.structured_output.compiler import GrammarCompiler

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]},
                                        "population_millions": {"type": "number"}},
        "required": ["city", "population_millions"]}
TAGS = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}
SCHEMAS = [PERSON, CITY, TAGS]
PROMPTS = ["Describe a person as JSON:", "Which city is the capital of France? Answer as JSON:",
           "Give three tags for a blog post about cats:", "Write a short poem about the sea."]
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=512, kv_cache_space=0.25, enable_prefix_caching=True) as engine:
        yield engine


def _json(schema, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=96, structured_outputs={"json": schema}, **kwargs)


def _check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_json_schema_regex_choice_and_grammar_outputs_validate(llm):
    params = [_json(PERSON), _json(CITY), _json(TAGS),
              SamplingParams(temperature=0, max_tokens=32, structured_outputs={"regex": PHONE}),
              SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["yes", "no"]}),
              SamplingParams(temperature=0, max_tokens=32, structured_outputs={
                  "grammar": 'root ::= "SELECT " col " FROM users"\ncol ::= "name" | "age" | "*"'}),
              SamplingParams(temperature=0, max_tokens=96, structured_outputs={"json_object": True})]
    prompts = PROMPTS[:3] + ["My phone number is", "Is the sky blue?", "Write SQL:", "Return a JSON object with a key \"ok\" set to true:"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    for text, schema in zip(texts[:3], SCHEMAS):
        _check_json(text, schema)
    assert re.fullmatch(PHONE, texts[3])
    assert texts[4] in ("yes", "no")
    assert re.fullmatch(r"SELECT (name|age|\*) FROM users", texts[5])
    assert isinstance(json.loads(texts[6]), dict)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_without_the_mask_the_same_prompts_do_not_validate(llm):
    """The oracle for the tests above: the model alone does not write these formats."""
    outs = llm.generate(PROMPTS[:3] + ["My phone number is"], SamplingParams(temperature=0, max_tokens=96),
                        use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    failures = 0
    for text, schema in zip(texts[:3], SCHEMAS):
        try:
            _check_json(text, schema)
        except (ValueError, jsonschema.ValidationError):
            failures += 1
    assert failures == 3
    assert not re.fullmatch(PHONE, texts[3])


def test_mixed_batch_n4_and_32_concurrent_requests(llm):
    """32 requests at once, mixed schemas and unconstrained ones, sampled (temperature 1, seeded),
    some with n=4 and logprobs: each constrained sample validates; unconstrained ones are not masked."""
    prompts, params, schemas = [], [], []
    for i in range(32):
        schema = SCHEMAS[i % 3] if i % 4 != 3 else None
        prompts.append(PROMPTS[i % 4] + f" (#{i})")
        kwargs = dict(temperature=1.0, seed=i, max_tokens=96, n=4 if i % 8 == 0 else 1,
                      logprobs=2 if i % 5 == 0 else None)
        params.append(SamplingParams(**kwargs, structured_outputs={"json": schema}) if schema
                      else SamplingParams(**kwargs))
        schemas.append(schema)
    outs = llm.generate(prompts, params, use_tqdm=False)
    checked = 0
    for out, schema, p in zip(outs, schemas, params):
        assert len(out.outputs) == p.n
        for sample in out.outputs:
            if schema is None:
                continue
            if sample.finish_reason == "stop":
                _check_json(sample.text, schema)
                checked += 1
            if p.logprobs is not None:
                assert len(sample.logprobs) == len(sample.token_ids)
    assert checked >= 30


def test_cut_by_max_tokens_is_a_valid_prefix(llm):
    import xgrammar as xgr

    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, structured_outputs={"json": PERSON}),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    compiled = llm.llm_engine.grammar_compiler.compile(StructuredOutputsParams(json=PERSON)).result()
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(t) for t in out.token_ids)
    assert not matcher.is_terminated()


def test_stop_strings_and_ignore_eos(llm):
    out = llm.generate([PROMPTS[0]], _json(PERSON, stop=['"age"']), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == '"age"' and '"age"' not in out.text
    # ignore_eos: the grammar still ends the output once it is complete
    out = llm.generate([PROMPTS[1]], _json(CITY, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    _check_json(out.text, CITY)


def test_preemption_multi_step_and_prefix_hits_keep_outputs_valid():
    """A pool of 10 blocks of 16 tokens for 6 requests, two of them 100 tokens long, forces
    preemption (recompute); windows of 8 steps run for the unconstrained requests; the same
    prompt twice hits the prefix cache."""
    with LLM(max_model_len=256, num_kv_blocks=10, enable_prefix_caching=True, num_scheduler_steps=8) as small:
        long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        prompts = [PROMPTS[0]] * 2 + PROMPTS[1:3] + [PROMPTS[3]] * 2
        params = [_json(PERSON), _json(PERSON), _json(CITY), _json(TAGS), long, long]
        outs = small.generate(prompts, params, use_tqdm=False)
        stats = small.llm_engine.get_stats()
        for out, schema in zip(outs, [PERSON, PERSON, CITY, TAGS]):
            _check_json(out.outputs[0].text, schema)
        assert [len(o.outputs[0].token_ids) for o in outs[4:]] == [100, 100]
        assert small.llm_engine.scheduler.num_preemptions_total > 0
        assert stats.prefix_cache_hits_total > 0
        # one constrained request beside a long one: windows run once the grammar's request is done
        windows = small.llm_engine.num_multi_step_windows
        outs = small.generate(PROMPTS[2:4], [_json(TAGS), long], use_tqdm=False)
        _check_json(outs[0].outputs[0].text, TAGS)
        assert small.llm_engine.num_multi_step_windows > windows


def test_tensor_parallel_ranks():
    with LLM(max_model_len=256, kv_cache_space=0.05, tensor_parallel_size=3) as three:
        outs = three.generate(PROMPTS[:3], [_json(s) for s in SCHEMAS], use_tqdm=False)
    for out, schema in zip(outs, SCHEMAS):
        _check_json(out.outputs[0].text, schema)


@pytest.mark.parametrize("value, param", [
    ({"json": {"type": "objectx"}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "(?<=a)b"}, "structured_outputs.regex"),
    ({"grammar": "root ::= missing"}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"json": PERSON, "regex": "a"}, "structured_outputs"),
    ({}, "structured_outputs"),
    ({"jsn": PERSON}, "structured_outputs"),
    ("a string", "structured_outputs"),
    # keywords the grammar would not enforce: refused rather than silently allowed
    ({"json": {"not": {"type": "string"}}}, "structured_outputs.json"),
    ({"json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, "structured_outputs.json"),
    ({"json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=b)b+"}}}},
     "structured_outputs.json"),
    ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "structured_outputs.json"),
    ({"json": {"$defs": {"x": {"if": {"type": "integer"}}}, "$ref": "#/$defs/x"}}, "structured_outputs.json"),
    ({"json": {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 5}}}}, "structured_outputs.json"),
    ({"json": {"type": "object", "properties": {"k": {}}, "patternProperties": {"^k$": {"not": {"type": "integer"}}},
               "required": ["k"]}}, "structured_outputs.json"),
    ({"json": {"type": "object", "propertyNames": {"not": {"const": "a"}}}}, "structured_outputs.json"),
    ({"json": {"$ref": "http://example.com/s.json"}}, "structured_outputs.json"),
])
def test_bad_constraints_name_the_field(value, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(structured_outputs=value)
    assert info.value.param == param
    assert "/project/cpp" not in str(info.value)


def test_a_slow_grammar_holds_back_only_its_own_request(llm, monkeypatch):
    """While a new schema compiles, the other requests run; the request starts once it is compiled."""
    engine = llm.llm_engine
    release = threading.Event()
    compile_original = GrammarCompiler._compile

    def slow(self, params):
        release.wait(30)
        return compile_original(self, params)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    slow_schema = {"type": "object", "properties": {"slow": {"type": "boolean"}}, "required": ["slow"]}
    engine.add_request("slow", "Is it slow? JSON:", _json(slow_schema))
    engine.add_request("other", PROMPTS[3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    texts, finished = {"slow": "", "other": ""}, set()

    def step() -> None:
        for out in engine.step():
            texts[out.request_id] += out.outputs[0].text if out.outputs else ""
            if out.finished:
                finished.add(out.request_id)

    for _ in range(30):
        step()
        if "other" in finished:
            break
    assert finished == {"other"} and texts["slow"] == ""
    assert engine.get_stats().num_waiting == 1
    release.set()
    while engine.has_unfinished_requests():
        step()
    _check_json(texts["slow"], slow_schema)


def test_bitmask_reference_against_a_loop():
    vocab = 70
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, bitmask_width(vocab)), generator=gen, dtype=torch.int64).to(
        torch.int32)
    rows = torch.tensor([3, 1])
    expected = logits.clone()
    for i, row in enumerate(rows.tolist()):
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    apply_token_bitmask_reference(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    assert not torch.isinf(logits[0]).any() and not torch.isinf(logits[2]).any()
