"""The request message a web process sends a worker, in the format of the model's queues, and the
names Celery knows a worker's queue by.

A :class:`QueuedRequest` travels as ``"<rid> <cost>\\n<JSON>"``: the header lets the dequeue script
(:data:`.queue_scripts.TAKE`) charge the request and find its claim without parsing the prompt.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class QueuedRequest:
    """One engine request on its way from a web process to a worker.

    Attributes:
        rid: the engine request id (unique across the cluster).
        reply: the Channels channel its messages go to.
        model: the served model's name.
        prompt_token_ids: the tokenized prompt.
        params: ``SamplingParams`` keyword arguments, validated by the web process.
        arrival: ``time.time()`` at the web process, in seconds.
        tenant: the tenant's slug (its GPU share), or None.
        priority: scheduling priority (lower runs earlier; the ``priority`` policy only).
        cache_salt: prefix-cache key, None to share with every unsalted request.
    """

    rid: str
    reply: str
    model: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    arrival: float
    tenant: str | None = None
    priority: int = 0
    cache_salt: str | None = None

    @property
    def cost(self) -> int:
        """Tokens the request may cost the engine, in tokens: its prompt plus ``n`` ×
        ``max_tokens`` (what the scheduler charges for admitting it)."""
        return max(1, len(self.prompt_token_ids)
                   + int(self.params.get("n") or 1) * int(self.params.get("max_tokens") or 0))

    def encode(self) -> str:
        """The queue's wire format: ``"<rid> <cost>\\n<JSON>"``."""
        return f"{self.rid} {self.cost}\n{json.dumps(asdict(self), separators=(',', ':'))}"

    @classmethod
    def decode(cls, raw: bytes | str) -> QueuedRequest:
        """Inverse of :meth:`encode`.

        Raises:
            ValueError: ``raw`` is not such a message.
        """
        text = raw.decode() if isinstance(raw, bytes) else raw
        _, sep, body = text.partition("\n")
        try:
            return cls(**json.loads(body)) if sep else cls(**json.loads(text))
        except (TypeError, json.JSONDecodeError) as error:
            raise ValueError(f"not a queued request: {error}") from None


def request_id_of(message: str) -> str:
    """The request id of an encoded :class:`QueuedRequest`, read from its header alone."""
    return message.split(" ", 1)[0]


def worker_hostname(worker_id: str) -> str:
    """The Celery node name of a worker (``celery inspect`` and the logs show it)."""
    return f"tessera@{worker_id}"


def worker_queue(worker_id: str) -> str:
    """The Celery queue a worker consumes: one of its own, which keeps it off Celery's default queue
    (requests do not pass through Celery: the worker's dispatcher takes them from the model's queues)."""
    return f"tessera.worker.{worker_id}"
