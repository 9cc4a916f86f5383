"""Everything that names a Redis key, holds a Lua script, or speaks another library's wire format.

* :mod:`.keys` — every ``tessera:*`` Redis key, with its type and contents;
* :mod:`.queue_scripts` — the Lua scripts of a request's way through Redis: the share-aware
  dequeue, the held records of taken requests and the claims;
* :mod:`.limit_scripts` — the Lua scripts of the tenants' gateway limits;
* :mod:`.wire` — the request message a web process sends a worker (:class:`~.wire.QueuedRequest`,
  ``"<rid> <cost>\\n<json>"``, its ``SamplingParams`` included) and the Celery queue names;
* :mod:`.channel_layer` — channels-redis's storage format: the workers' bulk publishing and the
  web processes' reading of their reply channels.

The modules that use them (:mod:`webapp.serving.request_queue`, :mod:`webapp.serving.held`,
:mod:`tenants.limits` ...) run the scripts and own the logic; this package owns the names and
formats that must agree between processes.
"""
