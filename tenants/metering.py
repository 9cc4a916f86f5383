"""One API request's account with its tenant: admission against the limits, then, when the
request ends however it ends, settlement of the limits and a usage record, both from the
tokens it actually used."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Awaitable, Iterable

from webapp.serving.web_redis import get_redis

from . import counters
from .identity import Caller
from .limits import Admission, admit, settle
from .usage import recorder

logger = logging.getLogger(__name__)

_background: set[asyncio.Task] = set()


def error_kind(status: int) -> str:
    """The usage error kind of an HTTP status."""
    if status == 429:
        return "rate_limited"
    if status in (502, 503, 504):
        return "unavailable"
    if status >= 500:
        return "internal"
    return "invalid_request"


class Meter:
    """The account of one generation request (chat or completions call).

    Call :meth:`admit` before enqueuing anything, and :meth:`finish` exactly when the request
    ends (later calls do nothing, so an error handler can call it as a fallback).
    """

    def __init__(self, caller: Caller) -> None:
        self.caller = caller
        self.model = ""
        self.admission: Admission | None = None
        self.finished = False

    def use_model(self, model: str, base_model: str | None = None) -> None:
        """The request is for ``model``: a served model, or a LoRA adapter of ``base_model``. Usage and counters
        name ``model`` (the adapter, for an adapter).

        Raises:
            TenantError: 403 ``model_not_allowed`` when the tenant may not use the (base) model.
        """
        self.caller.check_model(base_model or model)
        self.model = model

    async def admit(self, request_id: str, model: str, prompt_tokens: int, completion_tokens: int = 0,
                    choices: int = 1) -> int | None:
        """Take a concurrency slot, a request and ``prompt_tokens`` from the tenant's limits, and reserve in its
        daily budget the ``completion_tokens`` its ``choices`` answers may generate in all.

        The request ends with the task serving it, whoever ends it: when that task ends before
        :meth:`finish` (the client left and Django cancelled it before a stream's first chunk, or
        while this call waited for Redis), the admission is settled as ``aborted`` then, so its
        slot is not held until its lease expires.

        Returns:
            The most tokens each answer may generate within the tenant's daily budget, where that is fewer
            than asked for (the caller caps ``max_tokens`` to it); None otherwise.
        Raises:
            TenantError: 429 when a limit is reached (nothing is taken then).
        """
        self.model = model
        admitting = asyncio.ensure_future(admit(self.caller.tenant, request_id, prompt_tokens, completion_tokens,
                                                choices))
        try:
            self.admission = await asyncio.shield(admitting)
        except asyncio.CancelledError:
            admitting.add_done_callback(self._abort_late_admission)
            raise
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _task: self.finish(error="aborted"))  # no-op once finished
        return self.admission.max_tokens_cap if self.admission is not None else None

    def _abort_late_admission(self, admitting: asyncio.Future) -> None:
        """The admission that Redis granted after its request's task was cancelled: settle it at once (the
        request was already recorded as aborted, without it, when the cancel reached ``api_view``)."""
        if not admitting.cancelled() and admitting.exception() is None and admitting.result() is not None:
            self.admission = admitting.result()
            if self.finished:
                self._background(self._settle(self.admission, 0))
            else:
                self.finish(error="aborted")

    def finish(self, prompt_tokens: int = 0, completion_tokens: int = 0, error: str | None = None,
               finish_reasons: Iterable[str | None] = ()) -> None:
        """The request ended having used these tokens (``error``: a ``models.ERROR_KINDS`` kind;
        ``finish_reasons``: its choices'), for the usage records, the limits and the tenant's
        counters in ``/metrics`` (:mod:`.counters`)."""
        if self.finished:
            return
        self.finished = True
        if self.admission is not None:
            self._background(self._settle(self.admission, prompt_tokens + completion_tokens))
        self._record(prompt_tokens, completion_tokens, error, finish_reasons)

    def finish_later(self, prompt_tokens: int, completion_tokens: int, error: str | None,
                     finish_reasons: Iterable[str | None], more: Awaitable[tuple[int, int]]) -> None:
        """As :meth:`finish`, with the ``(prompt, completion)`` tokens that ``more`` resolves to added: those the
        engines computed for a request whose client left that its stream never saw
        (:attr:`webapp.serving.client.GenerationStream.left_behind`), so that leaving before the first token
        does not make a prefill free in the tenant's budget, token limits and usage. The concurrency slot and
        the budget's reservation are freed at once, but every prompt stays charged (as at admission) until
        ``more`` resolves, so that no request admitted meanwhile finds room the engine already used; then the
        limits are corrected to what was computed (prompts that never ran given back) and the usage is
        recorded. Returns at once."""
        if self.finished:
            return
        self.finished = True
        admission = self.admission
        held = completion_tokens + max(prompt_tokens, admission.charged_tokens if admission else 0)
        if admission is not None:
            self._background(self._settle(admission, held))

        async def account() -> None:
            extra = (0, 0)
            try:
                extra = await more
            except Exception:
                logger.exception("counting what the engines computed for an aborted request failed")
            used = prompt_tokens + extra[0] + completion_tokens + extra[1]
            if admission is not None and used != held:  # settling again only moves the tokens (slot and hold gone)
                await self._settle(replace(admission, charged_tokens=held), used)
            self._record(prompt_tokens + extra[0], completion_tokens + extra[1], error, finish_reasons)

        self._background(account())

    def _record(self, prompt_tokens: int, completion_tokens: int, error: str | None,
                finish_reasons: Iterable[str | None]) -> None:
        recorder.record(self.caller.tenant.id, self.model, prompt_tokens, completion_tokens, error,
                        self.caller.key_id)
        if self.model:
            self._background(self._count(prompt_tokens, completion_tokens,
                                         counters.finished_reason(error, finish_reasons)))

    @staticmethod
    def _background(coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        _background.add(task)
        task.add_done_callback(_background.discard)

    @staticmethod
    async def _settle(admission: Admission, used: int) -> None:
        try:
            await settle(admission, used)
        except Exception:
            logger.exception("settling the limits of request %s failed", admission.request_id)

    async def _count(self, prompt_tokens: int, completion_tokens: int, reason: str) -> None:
        try:
            await counters.add(get_redis(), self.caller.tenant.slug, self.model, prompt_tokens, completion_tokens,
                               reason)
        except Exception:
            logger.exception("counting the request of tenant %s failed", self.caller.tenant.slug)
