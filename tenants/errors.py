"""Errors of identification and admission, with what the API answers (OpenAI's envelope fields)."""
from __future__ import annotations


class TenantError(Exception):
    """A request refused on its tenant's account.

    Attributes:
        status: HTTP status (401, 403, 404 or 429).
        message: text for the client; never contains a secret.
        code: OpenAI-style code (``invalid_api_key``, ``tenant_not_found``, ``rate_limit_exceeded``, ...).
        param: the offending header or field, when there is one.
        type: OpenAI's error type (``requests`` or ``tokens`` for 429, as OpenAI sends).
        retry_after: seconds after which a retry can succeed (429 only).
        tenant_id, key_id: the known tenant (and key) that a refusal before a ``Caller`` exists (403
            inactive tenant, key of another tenant) is counted against in usage.
    """

    def __init__(self, message: str, status: int, code: str, param: str | None = None, type: str | None = None,
                 retry_after: int | None = None, tenant_id: int | None = None, key_id: int | None = None) -> None:
        super().__init__(message)
        self.tenant_id = tenant_id
        self.key_id = key_id
        self.message = message
        self.status = status
        self.code = code
        self.param = param
        self.type = type
        self.retry_after = retry_after
