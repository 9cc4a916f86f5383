"""In-process tests against the real ASGI app and the real Redis of the shared stack: the bulk
publisher's ordering (read back by the reply router) and coalescing. (The live-stats WebSocket
is tested in tests/dashboard/test_dashboard.py.)"""
from __future__ import annotations

import asyncio


def test_bulk_send_keeps_order_per_channel(django_app):
    from channels.layers import get_channel_layer

    from webapp.transport.channel_layer import bulk_send
    from webapp.serving.replies import reply_router

    async def run() -> tuple[dict[str, list[int]], list[int]]:
        layer = get_channel_layer()
        router = reply_router()
        received: list[list[int]] = [[] for _ in range(5)]
        channels = [router.open(lambda ms, into=into: into.extend(m["i"] for m in ms)) for into in received]
        got = dict(zip(channels, received))
        closed: list[int] = []
        router.close(late := router.open(lambda ms: closed.extend(m["i"] for m in ms)))
        for start in range(0, 300, 100):  # three pipelines of 100 messages per channel
            await bulk_send(layer, [(ch, {"type": "t", "i": i}) for i in range(start, start + 100)
                                    for ch in [*channels, late]])
        for _ in range(500):
            if all(len(v) == 300 for v in got.values()):
                break
            await asyncio.sleep(0.01)
        await router.aclose()  # a reader left to asyncio.run's cancellation can hang it (see aclose)
        return got, closed

    got, closed = asyncio.run(run())
    for received in got.values():
        assert received == list(range(300))
    assert closed == []  # a closed channel gets nothing


def test_coalesce_merges_deltas_of_one_request():
    from webapp.serving.messages import coalesce

    def delta(rid, text, ids, finish=None):
        return {"type": "delta", "rid": rid, "finished": finish is not None, "num_prompt_tokens": 3,
                "num_cached_tokens": 0, "prompt_logprobs": None, "metrics": {},
                "outputs": [{"index": 0, "text": text, "token_ids": ids, "logprobs": None, "finish_reason": finish,
                             "stop_reason": None}]}

    merged = coalesce([delta("a", "He", [1]), delta("b", "X", [9]), delta("a", "llo", [2, 3]),
                       delta("a", "!", [4], "stop"), delta("a", "late", [5])])
    assert [m["rid"] for m in merged] == ["a", "b"]
    out = merged[0]["outputs"][0]
    assert (out["text"], out["token_ids"], out["finish_reason"]) == ("Hello!", [1, 2, 3, 4], "stop")
    assert merged[0]["finished"] and not merged[1]["finished"]
