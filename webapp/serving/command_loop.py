"""The worker's command thread: takes model commands (:mod:`.commands`) from its Redis list
one at a time and carries them out on the worker's :class:`.model_lifecycle.ModelHost`.

A load takes seconds to minutes, so the thread is not Celery's: it starts once the Celery
worker is ready, and the outcome of a command shows in the heartbeat (``state``, ``error``).
"""
from __future__ import annotations

import logging
import threading
import time

import redis

from webapp.transport.keys import commands_key

from . import worker_slot
from .commands import LOAD, RELOAD, UNLOAD, ModelCommand
from .model_lifecycle import READY, ModelHost

logger = logging.getLogger(__name__)

COMMAND_POLL = 1.0  # seconds a BLPOP for commands blocks before checking for shutdown


class CommandLoop:
    """Carries out the model commands sent to one worker.

    Args:
        worker_id: the worker's id (its command list).
        redis_url: Redis of the command list and the worker slots.
        closing: set once the worker shuts down; the thread then ends.
        host: the worker's model host, which loads and unloads.
        slot: the worker's :mod:`worker slot <.worker_slot>` (None: started by hand), where the
            outcome of every command is recorded.
    """

    def __init__(self, worker_id: str, redis_url: str, closing: threading.Event, host: ModelHost,
                 slot: str | None) -> None:
        self.worker_id = worker_id
        self.host = host
        self.slot = slot
        self._redis_url = redis_url
        self._redis = redis.Redis.from_url(redis_url)
        self._closing = closing

    def run_command(self, command: ModelCommand) -> None:
        """Carry out one model command; a failed load is reported in the heartbeat, not raised."""
        host = self.host
        try:
            if command.op == UNLOAD:
                host.unload()
            elif command.op in (LOAD, RELOAD):
                spec = command.spec or host.spec
                if spec is None:
                    logger.warning("reload: this worker serves no model")
                    return
                host.load(spec)
        except Exception:  # a failed load is logged by load, and its state and error say what happened
            if command.op == UNLOAD:
                logger.exception("unloading failed")
        worker_slot.record(self._redis, self.slot, host.spec if host.state == READY else None)

    def start(self) -> None:
        """Take model commands on a thread of its own (returns at once)."""
        threading.Thread(target=self._run, name="tessera-worker-commands", daemon=True).start()

    def _run(self) -> None:
        client = redis.Redis.from_url(self._redis_url, socket_timeout=COMMAND_POLL + 30)
        while not self._closing.is_set():
            try:
                item = client.blpop([commands_key(self.worker_id)], timeout=COMMAND_POLL)
            except redis.RedisError:
                logger.exception("reading model commands failed")
                time.sleep(COMMAND_POLL)
                continue
            if self._closing.is_set():
                continue
            if item is None:
                continue
            try:
                command = ModelCommand.decode(item[1])
            except ValueError as error:
                logger.error("ignored a command: %s", error)
                continue
            self.run_command(command)
