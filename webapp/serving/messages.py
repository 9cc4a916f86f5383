"""Wire format of what workers send back on a request's reply channel, the abort the web sends a
worker, and coalescing. (The request itself, web to worker, is :class:`webapp.transport.wire.QueuedRequest`.)

A *delta* message carries what one engine request produced since the previous message:

``{"type": "delta", "rid": str, "seq": int, "finished": bool, "num_prompt_tokens": int,
"num_cached_tokens": int, "prompt_logprobs": list | None, "metrics": dict,
"outputs": [{"index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason"}]}``

``logprobs`` is, per output position, a list of ``[token_id, logprob, rank, decoded_token]``
(plain lists, so msgpack and JSON carry them unchanged), with a fifth item, the token's UTF-8 bytes, where the
token is part of a character (``decoded_token`` is then U+FFFD). An *error* message
``{"type": "error", "rid", "seq", "status", "message", "param"}`` ends the request.
``seq`` counts the messages of one engine request from 0, so the receiver can check order;
``worker`` names the worker that runs the request. An :class:`Abort` goes the other way, on the
worker's control channel; the worker answers each of its requests with an *aborted* message
``{"type": "aborted", "rid", "num_computed_prompt_tokens"}`` once its engine dropped it, so that the web
process can charge the tenant for a prompt whose prefill ran although nobody saw an answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict

if TYPE_CHECKING:
    from inference.outputs import RequestOutput


class Output(TypedDict):
    """One sample's part of a delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None
    stop_reason: int | str | None


class Delta(TypedDict):
    """What one engine request produced since its previous message."""

    type: Literal["delta"]
    rid: str
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list | None
    metrics: dict[str, Any]
    outputs: list[Output]
    seq: NotRequired[int]  # set when published
    worker: NotRequired[str]


class Error(TypedDict):
    """Ends an engine request with an error (HTTP ``status``)."""

    type: Literal["error"]
    rid: str
    status: int
    message: str
    param: str | None
    seq: NotRequired[int]
    worker: NotRequired[str]


class Aborted(TypedDict):
    """Worker to web, after an :class:`Abort`: the engine dropped request ``rid`` having computed
    ``num_computed_prompt_tokens`` of its prompt (prefix-cache hits included; 0 where its prefill had not
    begun or the worker did not have it). Not numbered: nothing of the request follows it."""

    type: Literal["aborted"]
    rid: str
    num_computed_prompt_tokens: int


def aborted_message(rid: str, num_computed_prompt_tokens: int) -> Aborted:
    return {"type": "aborted", "rid": rid, "num_computed_prompt_tokens": num_computed_prompt_tokens}


Message = Delta | Error


@dataclass(frozen=True)
class Abort:
    """Web to worker, on the worker's control channel: the clients of ``rids`` left. ``reply``: their
    reply channel, where the worker sends an :class:`Aborted` for each, also for one it no longer has."""

    rids: tuple[str, ...]
    reply: str | None = None

    def encode(self) -> dict[str, Any]:
        return {"type": "abort", "rids": list(self.rids), "reply": self.reply}

    @classmethod
    def decode(cls, message: dict[str, Any]) -> Abort | None:
        """The abort in a control-channel message, None for any other message."""
        if message.get("type") != "abort":
            return None
        return cls(tuple(str(rid) for rid in message.get("rids", ())), message.get("reply"))


def _encode_positions(positions: list[dict] | None) -> list | None:
    if positions is None:
        return None
    return [
        [[int(tid), float(lp.logprob), lp.rank, lp.decoded_token, *([lp.token_bytes] if lp.token_bytes else [])]
         for tid, lp in pos.items()]
        if pos is not None else None
        for pos in positions
    ]


def encode_output(out: RequestOutput) -> Delta:
    """A delta message (without ``seq``) from one ``RequestOutput`` delta of ``LLMEngine.step``."""
    return {
        "type": "delta",
        "rid": out.request_id,
        "finished": bool(out.finished),
        "num_prompt_tokens": len(out.prompt_token_ids or ()),
        "num_cached_tokens": int(out.num_cached_tokens or 0),
        "prompt_logprobs": _encode_positions(out.prompt_logprobs),
        "metrics": dict(out.metrics or {}),
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "logprobs": _encode_positions(c.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in out.outputs
        ],
    }


def error_message(rid: str, status: int, message: str, param: str | None = None) -> Error:
    """A message that ends request ``rid`` with an error (HTTP ``status``)."""
    return {"type": "error", "rid": rid, "status": status, "message": message, "param": param}


def merge_outputs(into: list[Message], new: list[Message]) -> None:
    """Append the per-sample deltas ``new`` onto ``into`` (same request), in place."""
    by_index = {o["index"]: o for o in into}
    for o in new:
        old = by_index.get(o["index"])
        if old is None:
            into.append(o)
            by_index[o["index"]] = o
            continue
        old["text"] += o["text"]
        old["token_ids"].extend(o["token_ids"])
        if o["logprobs"] is not None:
            old["logprobs"] = (old["logprobs"] or []) + o["logprobs"]
        if o["finish_reason"] is not None:
            old["finish_reason"] = o["finish_reason"]
            old["stop_reason"] = o["stop_reason"]


def coalesce(messages: list[Message]) -> list[Message]:
    """Merge consecutive messages of the same request into one, keeping request order.

    An error message replaces whatever was pending for its request; nothing of a request
    after its final message is kept.
    """
    merged: dict[str, Message] = {}
    for m in messages:
        rid = m["rid"]
        prev = merged.get(rid)
        if prev is None or m["type"] == "error":
            merged[rid] = m
        elif prev["type"] == "error" or prev["finished"]:
            continue
        else:
            merge_outputs(prev["outputs"], m["outputs"])
            prev["finished"] = m["finished"]
            prev["num_cached_tokens"] = m["num_cached_tokens"]
            prev["metrics"].update(m["metrics"])
            if prev["prompt_logprobs"] is None:
                prev["prompt_logprobs"] = m["prompt_logprobs"]
    return list(merged.values())


def is_final(message: Message) -> bool:
    return message["type"] == "error" or bool(message.get("finished"))
