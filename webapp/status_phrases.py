"""Reason phrases for the status line that Daphne writes.

ASGI carries only the status code (not Django's ``HttpResponse.reason_phrase``), and Daphne's
HTTP layer (Twisted's ``Request.setResponseCode``) looks the phrase up in
``twisted.web.http.RESPONSES``, which lacks the newer codes: 429 went out as
``HTTP/1.1 429 Unknown Status``. :func:`install` adds the standard phrase (RFC 6585, RFC 9110,
Python's ``http.HTTPStatus``) of every code Twisted does not know.
"""
from __future__ import annotations

from http import HTTPStatus


def install() -> list[int]:
    """Teach Twisted the standard reason phrase of every status it lacks (429 Too Many Requests,
    422, 428, 431, ...); returns the codes added. Does nothing when Twisted is not installed."""
    try:
        from twisted.web import http
    except ImportError:  # not under Daphne
        return []
    added = [status.value for status in HTTPStatus if status.value not in http.RESPONSES]
    for code in added:
        http.RESPONSES[code] = HTTPStatus(code).phrase.encode("ascii")
    return added
