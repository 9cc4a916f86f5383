"""The request message a web process sends a worker, in the format of the model's queues, and the
names Celery knows a worker's queue by.

A :class:`QueuedRequest` travels as ``"<rid> <cost>\\n<JSON>"``: the header lets the dequeue script
(:data:`.queue_scripts.TAKE`) charge the request and find its claim without parsing the prompt. Its
``SamplingParams`` travel as a JSON object of their dataclass fields (:func:`encode_fields`,
:func:`decode_fields`), so that a field added to ``SamplingParams`` travels without a change here:
enums go as their values, tuples as lists, and both come back as the field's type says.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar, Union

from inference.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass(frozen=True)
class QueuedRequest:
    """One engine request on its way from a web process to a worker.

    Attributes:
        rid: the engine request id (unique across the cluster).
        reply: the Channels channel its messages go to.
        model: the served model's name.
        prompt_token_ids: the tokenized prompt.
        params: the sampling parameters, validated by the web process.
        arrival: ``time.time()`` at the web process, in seconds.
        tenant: the tenant's slug (its GPU share), or None.
        priority: scheduling priority (lower runs earlier; the ``priority`` policy only).
        cache_salt: prefix-cache key, None to share with every unsalted request.
        lora_name: the LoRA adapter to run with (the name the client sent as ``model``), None: the base model.
        lora_path: the adapter's folder as registered (a worker that has not loaded it yet loads it from there).
    """

    rid: str
    reply: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    tenant: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None

    @property
    def cost(self) -> int:
        """Tokens the request may cost the engine, in tokens: its prompt plus ``n`` ×
        ``max_tokens`` (what the scheduler charges for admitting it)."""
        return max(1, len(self.prompt_token_ids) + self.params.n * (self.params.max_tokens or 0))

    def encode(self) -> str:
        """The queue's wire format: ``"<rid> <cost>\\n<JSON>"``."""
        return f"{self.rid} {self.cost}\n{json.dumps(encode_fields(self), separators=(',', ':'))}"

    @classmethod
    def decode(cls, raw: bytes | str) -> QueuedRequest:
        """Inverse of :meth:`encode`.

        Raises:
            InvalidParams: the message is one, but its sampling parameters do not decode here.
            ValueError: ``raw`` is not such a message.
        """
        text = raw.decode() if isinstance(raw, bytes) else raw
        _, sep, body = text.partition("\n")
        try:
            data = json.loads(body if sep else text)
            params = data.pop("params")
            request = decode_fields(cls, {**data, "params": {}})  # default sampling parameters, for now
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            raise ValueError(f"not a queued request: {error}") from None
        try:
            params = decode_fields(SamplingParams, params)
        except (TypeError, ValueError, AttributeError) as error:  # InvalidRequestError is a ValueError
            raise InvalidParams(request, error) from None
        return dataclasses.replace(request, params=params)


class InvalidParams(ValueError):
    """A queued request whose sampling parameters do not decode here (a web process of another
    version sent them): it is answered with a 400.

    Attributes:
        request: the request, with default sampling parameters in place of its own (to route the answer).
        error: why they did not decode (``param`` names the parameter when known).
    """

    def __init__(self, request: QueuedRequest, error: Exception) -> None:
        super().__init__(str(error))
        self.request = request
        self.error = error
        self.param: str | None = getattr(error, "param", None)


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


def encode_fields(obj: Any) -> dict[str, Any]:
    """A dataclass instance as a JSON-ready dict of its fields: nested dataclasses as dicts,
    enums as their values, tuples as lists (:func:`decode_fields` brings them back)."""
    return {field.name: _plain(getattr(obj, field.name)) for field in dataclasses.fields(obj)}


def decode_fields(cls: type[T], data: dict[str, Any]) -> T:
    """Inverse of :func:`encode_fields`: ``cls(**data)``, each value brought back to its field's
    annotated type (enums, tuples, dicts with integer keys, nested dataclasses). Fields missing
    from ``data`` take their defaults.

    Raises:
        TypeError: ``data`` is not a dict, or names a field ``cls`` does not have (``cls`` raises it).
        ValueError: a value does not fit its field (and whatever ``cls`` raises validating it).
    """
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__} fields must be a JSON object, got {type(data).__name__}")
    hints = _hints(cls)
    return cls(**{name: _revive(hints.get(name, Any), value) for name, value in data.items()})


@cache
def _hints(cls: type) -> dict[str, Any]:
    names = {field.name for field in dataclasses.fields(cls)}
    return {name: hint for name, hint in typing.get_type_hints(cls).items() if name in names}


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return encode_fields(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _revive(hint: Any, value: Any) -> Any:
    """``value`` as read from JSON, brought back to the type ``hint``."""
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        for arg in args:
            if arg is not type(None) and _fits(arg, value):
                return _revive(arg, value)
        return value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return decode_fields(hint, value)
    if origin in (list, tuple) and isinstance(value, list):
        item = args[0] if args else Any
        return origin(_revive(item, v) for v in value)
    if origin is dict and isinstance(value, dict):
        key, item = args if args else (Any, Any)
        return {(int(k) if key is int else k): _revive(item, v) for k, v in value.items()}
    return value


def _fits(hint: Any, value: Any) -> bool:
    """Whether a JSON ``value`` may be of type ``hint`` (to pick the member of a union)."""
    kind = typing.get_origin(hint) or hint
    if kind in (list, tuple):
        return isinstance(value, list)
    if kind is dict or (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        return isinstance(value, dict)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return kind is Any or (isinstance(kind, type) and isinstance(value, kind))
