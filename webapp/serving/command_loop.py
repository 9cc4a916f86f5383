"""The worker's command thread: takes model commands (:mod:`.commands`) from its Redis list
one at a time and carries them out (part of :class:`.runtime.WorkerRuntime`).

A load takes seconds to minutes, so the thread is not Celery's: it starts once the Celery
worker is ready, and the outcome of a command shows in the heartbeat (``state``, ``error``).
"""
from __future__ import annotations

import logging
import threading
import time

import redis

from . import worker_slot
from webapp.transport.keys import commands_key

from .commands import LOAD, RELOAD, UNLOAD, ModelCommand
from .model_lifecycle import READY

logger = logging.getLogger(__name__)

COMMAND_POLL = 1.0  # seconds a BLPOP for commands blocks before checking for shutdown


class CommandLoop:
    """The command part of :class:`.runtime.WorkerRuntime` (it uses that class's attributes
    and its :meth:`~.model_lifecycle.ModelLifecycle.load` / ``unload``)."""

    def run_command(self, command: ModelCommand) -> None:
        """Carry out one model command; a failed load is reported in the heartbeat, not raised."""
        try:
            if command.op == UNLOAD:
                self.unload()
            elif command.op in (LOAD, RELOAD):
                spec = command.spec or self.spec
                if spec is None:
                    logger.warning("reload: this worker serves no model")
                    return
                self.load(spec)
        except Exception:  # a failed load is logged by load, and its state and error say what happened
            if command.op == UNLOAD:
                logger.exception("unloading failed")
        worker_slot.record(self._redis, self.slot, self.spec if self.state == READY else None)

    def serve_commands(self) -> None:
        """Once the Celery worker is ready: take model commands on a thread of its own
        (returns at once)."""
        threading.Thread(target=self._command_loop, name="tessera-worker-commands", daemon=True).start()

    def _command_loop(self) -> None:
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
