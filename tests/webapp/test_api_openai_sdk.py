"""The official ``openai`` SDK against a live server with the real SmolLM2."""
from __future__ import annotations

import openai
import pytest

from tests.webapp.serving_stack import MODEL, http, sse_events
import json

CHAT = [{"role": "user", "content": "Name three colors."}]


def _stream_text(chunks) -> tuple[str, list]:
    chunks = list(chunks)
    text = "".join((c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta") else c.choices[0].text
                   for c in chunks if c.choices)
    return text, chunks


def test_chat_non_stream(stack):
    reply = stack.openai().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_equals_non_stream_with_seed(stack):
    client = stack.openai()
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=32, temperature=0.9, seed=1234)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    text, chunks = _stream_text(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert text == full and text


def test_completions_stream_equals_non_stream(stack):
    client = stack.openai()
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=20, temperature=0.8, seed=7)
    full = client.completions.create(**kwargs)
    text, chunks = _stream_text(client.completions.create(stream=True, **kwargs))
    assert full.object == "text_completion" and full.choices[0].text
    assert text == full.choices[0].text
    assert full.usage.completion_tokens == 20 or full.choices[0].finish_reason == "stop"


def test_every_stream_ends_with_done_and_usage_chunk(stack):
    for path, body in [("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "Hi"})]:
        status, headers, raw = http("POST", stack.base_url + path, dict(
            body, model=MODEL, max_tokens=8, ignore_eos=True, stream=True, stream_options={"include_usage": True}))
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        usage_chunk = json.loads(events[-2])
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
        assert isinstance(usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"], int)
        assert all(json.loads(e)["usage"] is None for e in events[:-2])


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": CHAT}),
                                        ("/v1/completions", {"prompt": "Hi", "echo": True})])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(stack, path, body):
    status, _, raw = http("POST", stack.base_url + path, dict(
        body, model=MODEL, max_tokens=5, ignore_eos=True, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert status == 200, raw
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    final = chunks.pop()
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5
    prompt_tokens = final["usage"]["prompt_tokens"]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    # the role (echo) chunk first; then the tokens, several to a chunk when a worker message carries several
    assert len(chunks) >= 2 and counts[0] == 0 and counts[-1] == 5 and counts == sorted(counts)
    for c in chunks:
        assert c["usage"]["prompt_tokens"] == prompt_tokens
        assert c["usage"]["total_tokens"] == prompt_tokens + c["usage"]["completion_tokens"]


def test_usage_always_reports_cached_prompt_tokens(stack):
    """``prompt_tokens_details.cached_tokens`` is there without a prefix-cache hit too (0 for a prompt
    shorter than a KV block), in streamed final usage as well, as OpenAI sends it; with a hit (the chat
    template's system prompt, sent before) it counts the hit's tokens, whole blocks of the prompt."""
    client = stack.openai()
    for reply in (client.completions.create(model=MODEL, prompt="Hi", max_tokens=1),
                  list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, stream=True,
                                                 stream_options={"include_usage": True}))[-1]):
        assert reply.usage.prompt_tokens_details.cached_tokens == 0, reply.usage
    for _ in range(2):  # the second one hits the first one's blocks
        reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < reply.usage.prompt_tokens and cached % 16 == 0, reply.usage


def test_completions_max_tokens_defaults_to_16_and_null_fills_the_context(stack):
    client = stack.openai()
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"
    long_prompt = [28] * 2040  # 8 tokens short of max_model_len 2048
    status, _, body = http("POST", stack.base_url + "/v1/completions",
                           {"model": MODEL, "prompt": long_prompt, "max_tokens": None, "ignore_eos": True})
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 8
    status, _, body = http("POST", stack.base_url + "/v1/completions", {"model": MODEL, "prompt": long_prompt})
    error = json.loads(body)["error"]  # the default 16 does not fit after 2040 prompt tokens
    assert status == 400 and error["param"] == "max_tokens" and "2056" in error["message"]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 1960}],
                                          extra_body={"ignore_eos": True})  # chat: no default, up to the context
    assert chat.usage.completion_tokens == 2048 - chat.usage.prompt_tokens > 16
    assert chat.choices[0].finish_reason == "length"


def test_n_samples_and_seed(stack):
    client = stack.openai()
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, n=3, temperature=1.0, seed=3)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, n=3, temperature=1.0, seed=3)
    assert [c.message.content for c in reply.choices] == [c.message.content for c in again.choices]
    text, chunks = _stream_text(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, n=3, temperature=1.0, seed=3, stream=True))
    streamed = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
                for i in range(3)}
    assert streamed == {c.index: c.message.content for c in reply.choices}


def test_batch_of_prompts_in_completions(stack):
    reply = stack.openai().completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=4,
                                              temperature=0, n=2)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    texts = {c.index: c.text for c in reply.choices}
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: both samples agree
    assert reply.usage.completion_tokens == 16


def test_chat_logprobs_shape(stack):
    reply = stack.openai().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                                   logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for position in content:
        assert position.logprob <= 0 and len(position.top_logprobs) == 3
        assert position.token == position.top_logprobs[0].token  # greedy picks the top token
        assert bytes(position.bytes).decode("utf-8", "replace")


def test_chat_logprobs_bytes_of_a_token_inside_a_character(stack):
    """SmolLM2 splits "日" (E6 97 A5) as " \\xe6" + "\\x97" + "\\xa5": forced by ``logit_bias``, the first token's
    text alone is U+FFFD, and its ``bytes`` are its own, so a client can join the character back."""
    reply = stack.openai().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0,
                                                   logit_bias={"17097": 100}, logprobs=True)
    position = reply.choices[0].logprobs.content[0]
    assert position.token == " \ufffd"
    assert position.bytes == list(" 日".encode("utf-8")[:2])


def test_completion_logprobs_shape(stack):
    reply = stack.openai().completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0,
                                              logprobs=2)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == reply.choices[0].text
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


def test_completion_top_logprobs_add_the_sampled_token(stack):
    """vLLM's legacy ``top_logprobs``: the ``logprobs`` most likely tokens and the sampled one when it is
    not among them; ``logprobs=0``: the sampled token alone."""
    client = stack.openai()
    kwargs = dict(model=MODEL, prompt="My favourite word is", max_tokens=24, temperature=1.5, seed=11)
    for top_n in (0, 2):
        lp = client.completions.create(logprobs=top_n, **kwargs).choices[0].logprobs
        assert len(lp.top_logprobs) == len(lp.tokens) == 24
        sizes = []
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert abs(top[token] - logprob) < 1e-4, (token, top)
            if len(top) == top_n + 1:  # the sampled token beyond the top ones: the least likely of them
                assert logprob == min(top.values())
            sizes.append(len(top))
        if top_n == 0:
            assert set(sizes) == {1}
        else:  # temperature 1.5 samples some tokens outside the top 2 (precondition of the check above)
            assert set(sizes) <= {2, 3} and 3 in sizes, sizes


def test_max_completion_tokens_and_vllm_extras(stack):
    reply = stack.openai().chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=6, temperature=0.7, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, logit_bias={"198": -100}, seed=1,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 6, "ignore_eos": True,
                    "stop_token_ids": [], "include_stop_str_in_output": False, "skip_special_tokens": True,
                    "priority": 0})
    assert reply.usage.completion_tokens == 6 and reply.choices[0].finish_reason == "length"
    assert "\n" not in reply.choices[0].message.content  # token 198 is "\n", banned by the bias


def test_stop_string_never_leaks(stack):
    client = stack.openai()
    base = dict(model=MODEL, prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=24, temperature=0)
    free = client.completions.create(**base).choices[0].text
    assert " 11," in free, free  # the model counts on; the stop string below occurs in its output
    stop = " 11,"
    expected = free[:free.index(stop)]
    full = client.completions.create(stop=[stop], **base).choices[0]
    assert full.text == expected and full.finish_reason == "stop"
    streamed, chunks = _stream_text(client.completions.create(stop=[stop], stream=True, **base))
    assert streamed == expected
    assert all(stop not in (c.choices[0].text or "") for c in chunks)


def test_multibyte_characters_never_split(stack):
    client = stack.openai()
    base = dict(model=MODEL, messages=[{"role": "user", "content": "Translate to Chinese: I love my family."}],
                max_tokens=40, temperature=0)
    full = client.chat.completions.create(logprobs=True, **base).choices[0]
    text = full.message.content
    # Precondition: the answer has CJK characters (3 bytes in UTF-8) made of several tokens,
    # i.e. tokens that are partial characters on their own.
    assert any(ord(ch) > 0x2E80 for ch in text), text
    assert sum(p.token == "\ufffd" for p in full.logprobs.content) >= 2
    assert "\ufffd" not in text  # a character cut by max_tokens is dropped, as vLLM does
    _, chunks = _stream_text(client.chat.completions.create(stream=True, **base))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_tenant_header_selects_tenant(stack):
    client = stack.openai()
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                           extra_headers={"X-Tenant-ID": "default"})
    assert reply.choices[0].message.content is not None
    import openai

    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                       extra_headers={"X-Tenant-ID": "no-such-tenant"})
    assert "Tenant not found" in str(error.value)


def test_models_list(stack):
    models = stack.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == 2048
    one = stack.openai().models.retrieve(MODEL)
    assert one.id == MODEL and one.max_model_len == 2048
    with pytest.raises(openai.NotFoundError):
        stack.openai().models.retrieve("no-such-model")


def test_completions_echo(stack):
    client = stack.openai()
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain
    streamed, _ = _stream_text(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                                         echo=True, stream=True))
    assert streamed == prompt + plain
