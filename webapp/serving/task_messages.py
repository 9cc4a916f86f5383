"""``tessera.generate`` task messages, written straight onto a model's Celery queue in Redis.

The web process enqueues every request on its event loop. Celery's ``send_task`` is
blocking (it had to run in a worker thread) and costs about 1.3 ms per request on 2 CPU
cores, mostly kombu building a new Redis client for every publish; here the message is
built once with Celery's own task-message factory (protocol 2) and pushed with one
``LPUSH`` per batch of prompts: about 0.2 ms on the event loop, no thread hop.

What is pushed is what kombu's Redis transport stores for ``send_task(name,
args=[payload], queue=queue)`` (default exchange, routing key = queue name, priority 0,
which is the queue's own list key), so a Celery worker consuming the queue receives an
ordinary task message: acknowledgement, redelivery and rejection work unchanged, and any
worker of the model may take it.
"""
from __future__ import annotations

import base64
import os
import socket
import uuid
from typing import Any

from kombu.serialization import dumps as dump_body
from kombu.utils.json import dumps as dump_envelope

from webapp.celery import app as celery_app
from webapp.tasks import GENERATE_TASK

_ORIGIN = f"gen{os.getpid()}@{socket.gethostname()}"


def generate_message(queue: str, payload: dict[str, Any]) -> str:
    """One ``tessera.generate`` task for ``payload``, serialized as kombu's Redis transport
    stores it in the list ``queue`` (JSON; the body is JSON, base64-encoded).

    The logs show the task as ``[rid=...]``: Celery's default argument repr (a bounded repr
    of the prompt's token ids) costs about a millisecond per request.
    """
    task_id = str(uuid.uuid4())
    message = celery_app.amqp.as_task_v2(task_id, GENERATE_TASK, args=[payload], kwargs={},
                                         argsrepr=f"[rid={payload['rid']}]", kwargsrepr="{}",
                                         origin=_ORIGIN, ignore_result=True)
    content_type, content_encoding, body = dump_body(message.body, serializer="json")
    properties = dict(message.properties, delivery_mode=2, priority=0, body_encoding="base64",
                      delivery_info={"exchange": "", "routing_key": queue}, delivery_tag=str(uuid.uuid4()))
    return dump_envelope({"body": base64.b64encode(body.encode()).decode(), "content-encoding": content_encoding,
                          "content-type": content_type, "headers": message.headers, "properties": properties})


# KEYS[1] a queue; ARGV: request ids. Removes their messages (found by the "[rid=...]" argsrepr in
# the headers: the body is base64, so the bracket occurs nowhere else), keeping the others in order.
_DROP_SCRIPT = """
local drop = {}
for i = 1, #ARGV do drop[ARGV[i]] = true end
local items = redis.call('LRANGE', KEYS[1], 0, -1)
local keep, removed = {}, 0
for _, item in ipairs(items) do
  local rid = string.match(item, '%[rid=([^%]]+)%]')
  if rid and drop[rid] then removed = removed + 1 else keep[#keep + 1] = item end
end
if removed > 0 then
  redis.call('DEL', KEYS[1])
  for i = 1, #keep, 1000 do redis.call('RPUSH', KEYS[1], unpack(keep, i, math.min(i + 999, #keep))) end
end
return removed
"""


async def drop_queued(redis, queue: str, request_ids: list[str]) -> int:
    """Remove the messages of ``request_ids`` still waiting in ``queue`` (one atomic script, linear
    in the queue's length); returns how many it removed. For a client that left a large batch:
    its requests are marked aborted, but each message would otherwise still pass through a worker
    (hundreds a second) before the tenant's next request is reached.

    Raises:
        RedisError: the broker could not be reached.
    """
    return int(await redis.eval(_DROP_SCRIPT, 1, queue, *request_ids))


async def enqueue(redis, queue: str, payloads: list[dict[str, Any]]) -> None:
    """Put one task per payload on ``queue``, in list order, with one ``LPUSH``.

    ``redis``: an asyncio Redis client of the Celery broker.

    Raises:
        RedisError: the broker could not be reached (nothing or everything was enqueued).
    """
    await redis.lpush(queue, *[generate_message(queue, p) for p in payloads])


def enqueue_blocking(redis, queue: str, payloads: list[dict[str, Any]]) -> None:
    """:func:`enqueue` for a thread (``redis``: a blocking client), e.g. a worker's requeue."""
    redis.lpush(queue, *[generate_message(queue, p) for p in payloads])
