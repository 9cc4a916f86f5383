"""Start and stop consuming a model's Celery queue in this worker process, without a restart.

Uses Celery's remote-control commands ``add_consumer`` / ``cancel_consumer`` addressed to
this worker's own node name: the worker's consumer thread runs them between its own
broker operations (the consumer is not thread-safe, so no other thread touches it), and
answers, so the caller knows the queue is consumed (or no longer is) when the call returns.
"""
from __future__ import annotations

from typing import Any

REPLY_TIMEOUT = 10.0  # seconds


class QueueControlError(RuntimeError):
    """The worker's Celery consumer did not confirm the change."""


class CeleryQueues:
    """The queues one Celery worker node consumes.

    Args:
        app: the Celery app.
        hostname: the worker's node name (``tessera@<worker id>``).
    """

    def __init__(self, app: Any, hostname: str) -> None:
        self.app = app
        self.hostname = hostname

    def consume(self, queue: str) -> None:
        """Start consuming ``queue`` (declared if new).

        Raises:
            QueueControlError: no confirmation within ``REPLY_TIMEOUT`` seconds, or an error.
        """
        self._check(self.app.control.add_consumer(queue, destination=[self.hostname], reply=True,
                                                  timeout=REPLY_TIMEOUT), f"consume {queue}")

    def cancel(self, queue: str) -> None:
        """Stop consuming ``queue`` (messages already reserved are still delivered).

        Raises:
            QueueControlError: as :meth:`consume`.
        """
        self._check(self.app.control.cancel_consumer(queue, destination=[self.hostname], reply=True,
                                                     timeout=REPLY_TIMEOUT), f"stop consuming {queue}")

    def _check(self, replies: list[dict[str, Any]] | None, what: str) -> None:
        for reply in replies or ():
            answer = reply.get(self.hostname)
            if answer is not None:
                if "error" in answer:
                    raise QueueControlError(f"could not {what}: {answer['error']}")
                return
        raise QueueControlError(f"could not {what}: the worker's Celery consumer did not answer "
                                f"within {REPLY_TIMEOUT:.0f} s")
