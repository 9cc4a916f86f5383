"""``manage.py worker [MODEL] [engine flags]``: a Celery worker hosting one engine at a time.

Start more of them (same flags, same ``REDIS_URL``) to serve a model data-parallel: they
all take from the model's queues, in the order of the tenants' shares (counted over all of them). ``manage.py serve`` starts one for you. ``--no-model`` starts
a worker without a model, to which the admin loads one (Models and workers > Workers); the
engine flags are then the defaults that a loaded model's own settings are laid over.
"""
from __future__ import annotations

import logging

from celery.signals import worker_ready, worker_shutting_down
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from inference import LLMEngine
from inference.errors import TesseraError
from webapp.celery import app as celery_app
from webapp.cli import add_engine_arguments, add_worker_arguments, engine_args_from_options
from webapp.serving.model_spec import ModelSpec
from webapp.serving.runtime import WorkerRuntime
from webapp.transport.wire import worker_hostname, worker_queue

logger = logging.getLogger("tessera.worker")


class Command(BaseCommand):
    help = "Run a Celery worker that hosts an inference engine and serves its model's queues."

    def add_arguments(self, parser) -> None:
        add_engine_arguments(parser)
        add_worker_arguments(parser)
        parser.add_argument("--no-model", action="store_true",
                            help="Start without a model; load one from the admin (Workers > Load).")
        parser.add_argument("--log-level", default=settings.LOGGING["root"]["level"].lower(),
                            choices=["debug", "info", "warning", "error", "critical"])

    def handle(self, *args, **options) -> None:
        engine_args = engine_args_from_options(options)
        logging.getLogger().setLevel(options["log_level"].upper())
        for logger_name in ("celery.app.trace", "celery.worker.strategy"):  # two lines per request otherwise
            logging.getLogger(logger_name).setLevel(max(logging.WARNING, logging.getLogger().level))
        runtime = WorkerRuntime(engine_args, settings.CELERY_BROKER_URL, get_channel_layer(),
                                LLMEngine.from_engine_args, options["max_waiting_requests"])
        try:
            runtime.start(None if options["no_model"] else ModelSpec.from_engine_args(engine_args))
        except TesseraError as error:
            runtime.close()
            raise CommandError(str(error)) from error
        hostname = worker_hostname(runtime.worker_id)
        worker_shutting_down.connect(lambda **_: runtime.begin_shutdown(), weak=False)
        worker_ready.connect(lambda **_: runtime.serve_commands(), weak=False)
        queues = [worker_queue(runtime.worker_id)]  # requests do not pass through Celery (see worker_queue)
        worker = celery_app.Worker(
            hostname=hostname, queues=queues, pool_cls="threads",
            concurrency=1, prefetch_multiplier=1, loglevel=options["log_level"].upper(),
            without_mingle=True, without_gossip=True, without_heartbeat=True, optimization="fair")
        try:
            worker.start()
        finally:
            runtime.close()
        if worker.exitcode:
            raise SystemExit(worker.exitcode)
