"""The runtime LoRA adapters as Redis holds them for the workers, and the adapter check a web process
asks of one worker before it registers an adapter. No Django here: the database side is
:mod:`webapp.catalog.lora`.

* The registry (:data:`webapp.transport.keys.LORA_ADAPTERS_KEY`): every adapter registered at run time,
  as :class:`AdapterEntry`. Workers read it with each heartbeat and keep their engine's adapters in step
  (:meth:`webapp.serving.lora_adapters.EngineAdapters.sync`); a worker started later reads it at its first
  heartbeat.
* The check (:class:`LoRACheck`): the web process sends it on a ready worker's control channel; the worker
  loads the adapter into its engine (``LLMEngine.add_lora``: path, files, rank against
  ``--max-lora-rank``, shapes against the base model) and pushes :class:`CheckResult` to a reply list the
  web process waits on. Only an adapter that passed is registered, so nothing is registered half.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from webapp.transport.keys import lora_reply_key

CHECK_TIMEOUT = 60.0  # seconds a web process waits for a worker's answer (a load reads the adapter from disk)
REPLY_TTL = 60  # seconds a worker's answer is kept for a web process that has not read it


@dataclass(frozen=True)
class AdapterEntry:
    """One registered adapter.

    Attributes:
        name: the name clients send as ``model`` (unique in the deployment).
        base_model: the served model it runs on.
        path: its PEFT folder, as the workers see it.
        tenant: the slug of the tenant that owns it (only that tenant may use it); None: public.
    """

    name: str
    base_model: str
    path: str
    tenant: str | None = None

    def encode(self) -> str:
        return json.dumps({"base_model": self.base_model, "path": self.path, "tenant": self.tenant})


def decode_registry(raw: dict[bytes | str, bytes | str]) -> dict[str, AdapterEntry]:
    """The registry's hash (``HGETALL``) as ``name -> AdapterEntry``; unreadable entries are skipped."""
    entries = {}
    for name, value in raw.items():
        name = name.decode() if isinstance(name, bytes) else name
        try:
            data = json.loads(value)
            entries[name] = AdapterEntry(name, str(data["base_model"]), str(data["path"]), data.get("tenant"))
        except (ValueError, KeyError, TypeError):
            continue
    return entries


def adapters_of(entries: dict[str, AdapterEntry], model: str | None) -> dict[str, str]:
    """``name -> path`` of the adapters of base model ``model``."""
    return {e.name: e.path for e in entries.values() if model is not None and e.base_model == model}


@dataclass(frozen=True)
class LoRACheck:
    """Web to worker, on the worker's control channel: load adapter ``name`` from ``path`` and answer
    on the list ``reply`` (:func:`webapp.transport.keys.lora_reply_key`)."""

    name: str
    path: str
    reply: str

    def encode(self) -> dict[str, Any]:
        return {"type": "lora_check", "name": self.name, "path": self.path, "reply": self.reply}

    @classmethod
    def decode(cls, message: dict[str, Any]) -> LoRACheck | None:
        """The check in a control-channel message, None for any other message."""
        if message.get("type") != "lora_check":
            return None
        return cls(str(message.get("name", "")), str(message.get("path", "")), str(message.get("reply", "")))


@dataclass(frozen=True)
class CheckResult:
    """A worker's answer to a :class:`LoRACheck`: ``ok``, or the refusal's ``message`` and the ``param``
    (field or limit) it names; ``status`` is the HTTP status it maps to (400 refused, 503 not served)."""

    ok: bool
    message: str = ""
    param: str | None = None
    status: int = 400

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> CheckResult:
        data = json.loads(raw)
        return cls(bool(data["ok"]), str(data.get("message", "")), data.get("param"), int(data.get("status", 400)))


async def check_on_worker(layer: Any, redis: Any, control: str, name: str, path: str,
                          timeout: float = CHECK_TIMEOUT) -> CheckResult:
    """Ask the worker listening on ``control`` to load adapter ``name`` from ``path``; its answer.

    ``layer``: the Channels layer; ``redis``: a ``redis.asyncio.Redis`` of the same Redis.
    Returns a 503 :class:`CheckResult` when the worker does not answer within ``timeout`` seconds.

    Raises:
        RedisError: Redis is unreachable.
    """
    reply = lora_reply_key(uuid.uuid4().hex)
    await layer.send(control, LoRACheck(name, path, reply).encode())
    answer = await redis.blpop([reply], timeout=timeout)
    if answer is None:
        return CheckResult(False, f"No worker answered within {timeout:.0f} s while loading the adapter; retry.",
                           None, 503)
    return CheckResult.decode(answer[1])


async def answer_check(redis: Any, check: LoRACheck, result: CheckResult) -> None:
    """Worker side: push ``result`` to the check's reply list (kept ``REPLY_TTL`` seconds)."""
    pipe = redis.pipeline(transaction=True)
    pipe.rpush(check.reply, result.encode())
    pipe.expire(check.reply, REPLY_TTL)
    await pipe.execute()


async def wait_result(future: Any) -> CheckResult:
    """Worker side: the :class:`CheckResult` of an ``EngineLoop.add_lora`` future (None: no engine)."""
    if future is None:
        return CheckResult(False, "This worker serves no model now; retry.", None, 503)
    try:
        await asyncio.wrap_future(future)
    except Exception as error:  # noqa: BLE001 - InvalidRequestError names the limit; anything else too
        return CheckResult(False, str(error), getattr(error, "param", None), 400)
    return CheckResult(True)
