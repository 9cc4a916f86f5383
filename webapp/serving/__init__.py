"""Moving requests between the web processes and the engine workers (Celery, Redis, Channels).

Web side: :mod:`.client` (enqueue, stream back, watch the worker, abort), :mod:`.replies`
(one reader per process that hands the workers' messages to their streams).
Worker side: :mod:`.runtime` (one engine per worker; its parts :mod:`.model_lifecycle`,
:mod:`.command_loop`, :mod:`.admission`, :mod:`.heartbeat_info`), :mod:`.engine_loop` (the step
loop, no I/O), :mod:`.io_loop` (Redis I/O: publish deltas in bulk, receive aborts,
heartbeats). Shared: :mod:`.messages` (wire format), :mod:`.registry` (Redis keys).
"""
