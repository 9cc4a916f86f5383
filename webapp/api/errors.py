"""Errors in OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from django.http import JsonResponse

from inference.errors import InvalidRequestError, NotSupportedYetError
from tenants.errors import TenantError

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error the API answers with, in OpenAI's envelope.

    Attributes:
        status: HTTP status code.
        message: human-readable text.
        type: OpenAI's error type (``invalid_request_error`` for the client's mistakes).
        param: the offending request field, when there is one.
        code: a short machine-readable code (``model_not_found``, ...).
        retry_after: seconds, sent as the ``Retry-After`` header (429).
        allow: the methods a 405 names in its ``Allow`` header (RFC 9110).
    """

    def __init__(self, message: str, status: int = 400, type: str | None = None,
                 param: str | None = None, code: str | None = None, retry_after: int | None = None,
                 allow: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.allow = allow
        self.message = message
        self.status = status
        if status == 503 and type is None:  # one envelope for every 503 (see ``unavailable``)
            type, code = "service_unavailable", code or "service_unavailable"
        self.type = type or ("invalid_request_error" if status < 500 else _TYPES.get(status, "server_error"))
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JsonResponse:
        response = JsonResponse(self.body(), status=self.status)
        if self.retry_after is not None:
            response["Retry-After"] = str(self.retry_after)
        if self.allow:
            response["Allow"] = ", ".join(self.allow)
        return response

    @classmethod
    def from_engine(cls, error: InvalidRequestError | NotSupportedYetError) -> "APIError":
        """Translate an engine validation error (which names its parameter) into a 400."""
        return cls(str(error), 400, param=getattr(error, "param", None))

    @classmethod
    def from_tenant(cls, error: TenantError) -> "APIError":
        """A refusal on the tenant's account (401, 403, 404, 429 with ``Retry-After``)."""
        return cls(error.message, error.status, type=error.type, param=error.param, code=error.code,
                   retry_after=error.retry_after)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 404, param=param, code=code)


def unavailable(message: str) -> APIError:
    return APIError(message, 503, type="service_unavailable", code="service_unavailable")


QUEUE_UNREACHABLE = "The request queue (Redis) is unreachable; retry the request."


def queue_unreachable() -> APIError:
    """The 503 of a request that Redis failed: the message says so without Redis's address
    (which ``str()`` of a connection error carries, e.g. ``Error 111 connecting to host:port``)."""
    return unavailable(QUEUE_UNREACHABLE)


def no_worker(model: str) -> APIError:
    """The 503 of a request for a model that no live worker serves."""
    return unavailable(f"No worker is serving model '{model}' now; retry later.")


def handler404(request, exception=None) -> JsonResponse:
    """Unknown URL: an OpenAI-style 404 rather than Django's HTML page."""
    return not_found(f"Not found: {request.path}", code="not_found").response()


def handler500(request) -> JsonResponse:
    return APIError("The server had an internal error.", 500, type="internal_server_error").response()
