"""Moving requests between the web processes and the engine workers (Redis, Channels; Celery hosts the workers).

Web side: :mod:`.client` (enqueue, stream back, watch the worker, abort), :mod:`.replies`
(one reader per process that hands the workers' messages to their streams).
Worker side: :mod:`.runtime` (one engine per worker; its parts :mod:`.model_lifecycle`,
:mod:`.command_loop`, :mod:`.heartbeat_info`), :mod:`.dispatcher` (takes requests from the queues
into the engine by the tenants' shares), :mod:`.engine_loop` (the step loop, no I/O),
:mod:`.io_loop` (Redis I/O: publish deltas in bulk, receive aborts, heartbeats), :mod:`.held`
(requests taken but not started, requeued when their worker dies), :mod:`.ledger` (what a
worker knows of each request it took, until it ends).
Shared: :mod:`.request_queue` (the queues and the share-aware dequeue), :mod:`.messages` (the
reply wire format), :mod:`.worker_registry` (workers' heartbeats and claims). The Redis key names, the Lua
scripts and the request message's wire format live in :mod:`webapp.transport`.
"""
