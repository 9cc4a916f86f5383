"""What a web process does once, when Daphne loads the ASGI application, before its first request.

* :func:`webapp.status_phrases.install`: Twisted learns the reason phrases it lacks, so Daphne's
  status line reads ``429 Too Many Requests``, not ``429 Unknown Status``.
* :func:`webapp.api.tokenization.warm_up_tokenizers`: the served models' tokenizers load in a
  background thread, so the first request does not wait for them.
* :func:`tenants.shares.publish`: the tenants' GPU shares are written to Redis for the workers'
  schedulers, also when Redis started empty.

Why here: Daphne has no ASGI lifespan; what every web process goes through once, before its
first request, is Daphne's import of ``webapp.asgi:application`` (started by :mod:`webapp.launcher`
for ``manage.py serve``, by ``deploy/Dockerfile``, or by hand), so
:func:`webapp.asgi.build_application` calls :func:`start_web_process`. Not in
``AppConfig.ready()``: that runs in every process that sets Django up, the Celery engine workers
and every management command too (``migrate`` would write to Redis, each worker would load the
tokenizers a second time). Not on the first request: that request would wait for the Redis write
and the tokenizers.
"""
from __future__ import annotations

from tenants.shares import publish as publish_tenant_shares
from webapp.api.tokenization import warm_up_tokenizers
from webapp.status_phrases import install as install_status_phrases


def start_web_process() -> None:
    """Prepare this web process to serve (see the module docstring); call once, after
    ``django.setup()``. Returns at once except for the Redis write (a few ms; at most the
    connect timeout, 2 s, when Redis is unreachable: logged, not raised)."""
    install_status_phrases()
    warm_up_tokenizers()
    publish_tenant_shares()
