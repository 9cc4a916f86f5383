"""200 concurrent streams: every token delivered once, in order."""
from __future__ import annotations

import asyncio
import json

from tests.webapp.raw_http import stream
from tests.webapp.serving_stack import MODEL, http

NUM_STREAMS = 200
MAX_TOKENS = 16


def test_200_concurrent_streams_deliver_every_token_once_in_order(stack):
    # Counting prompts: greedy continuations with large margins, so batching cannot flip a token.
    prompts = [f"{k}, {k + 1}, {k + 2}, {k + 3}," for k in range(1, NUM_STREAMS + 1)]
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}

    # Reference: all prompts in one non-streamed batch request.
    status, _, raw = http("POST", stack.base_url + "/v1/completions", dict(body, prompt=prompts), timeout=300)
    assert status == 200, raw
    reference = {c["index"]: c["text"] for c in json.loads(raw)["choices"]}
    assert len(reference) == NUM_STREAMS

    async def run_all():
        return await asyncio.gather(*[
            stream(stack.base_url, "/v1/completions",
                   dict(body, prompt=p, stream=True, stream_options={"include_usage": True}))
            for p in prompts])

    results = asyncio.run(asyncio.wait_for(run_all(), 300))
    mismatches = []
    for k, (status, events) in enumerate(results):
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
        if text != reference[k]:
            mismatches.append((prompts[k], text, reference[k]))
    assert not mismatches, mismatches[:3]
