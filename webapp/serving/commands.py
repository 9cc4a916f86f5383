"""Model commands to one worker: load, unload, reload, over a Redis list per worker.

Why a list of its own and not a Celery task: a worker consumes only its model's queue, and
an idle worker (no model) consumes none, so a task could not reach it; a task on a model's
queue would go to any worker of the model, not the one chosen. The admin ``RPUSH``es a
JSON command onto its list (:func:`webapp.transport.keys.commands_key`); the worker's command thread ``BLPOP``s
them one at a time (a load takes seconds to minutes) and reports the outcome in its
heartbeat (``state``, ``error``; see :mod:`.worker_registry`). The list expires ``COMMAND_TTL``
seconds after the last push, so commands to a worker that died do not pile up.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from webapp.transport.keys import commands_key

from .model_spec import ModelSpec

LOAD, UNLOAD, RELOAD = "load", "unload", "reload"
OPS = (LOAD, UNLOAD, RELOAD)
COMMAND_TTL = 600  # seconds


@dataclass(frozen=True)
class ModelCommand:
    """One command to a worker.

    Attributes:
        op: ``load`` (unloads the current model first), ``unload`` or ``reload`` (unload,
            then load ``spec``, or the current model's spec again when ``spec`` is None).
        spec: the model to load (``load``: required; ``reload``: optional).
    """

    op: str
    spec: ModelSpec | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be one of {', '.join(OPS)}, got {self.op!r}")
        if self.op == LOAD and self.spec is None:
            raise ValueError("a load command needs the model's spec")

    def encode(self) -> str:
        return json.dumps({"op": self.op, "spec": self.spec.to_json() if self.spec else None})

    @classmethod
    def decode(cls, raw: bytes | str) -> "ModelCommand":
        """Raises:
            ValueError: not a command (bad JSON, unknown op or spec fields).
        """
        try:
            data: dict[str, Any] = json.loads(raw)
            spec = ModelSpec.from_json(data["spec"]) if data.get("spec") else None
            return cls(data["op"], spec)
        except (TypeError, KeyError, json.JSONDecodeError) as error:
            raise ValueError(f"not a model command: {error}") from error


def send_command(redis, worker_id: str, command: ModelCommand) -> None:
    """Queue ``command`` for ``worker_id`` (``redis`` is a synchronous ``redis.Redis``)."""
    pipe = redis.pipeline(transaction=True)
    pipe.rpush(commands_key(worker_id), command.encode())
    pipe.expire(commands_key(worker_id), COMMAND_TTL)
    pipe.execute()
