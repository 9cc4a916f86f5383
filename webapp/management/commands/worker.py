"""``manage.py worker [MODEL] [engine flags]``: a Celery worker hosting one engine.

Start more of them (same flags, same ``REDIS_URL``) to serve a model data-parallel: they
all consume the model's queue. ``manage.py serve`` starts one for you.
"""
from __future__ import annotations

import logging

from celery.signals import worker_shutting_down
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from inference import LLMEngine
from inference.errors import TesseraError
from webapp.celery import app as celery_app, queue_for
from webapp.cli import add_engine_arguments, engine_args_from_options
from webapp.serving.runtime import WorkerRuntime, install_runtime

logger = logging.getLogger("tessera.worker")


class Command(BaseCommand):
    help = "Run a Celery worker that hosts one inference engine and serves its model's queue."

    def add_arguments(self, parser) -> None:
        add_engine_arguments(parser)
        parser.add_argument("--log-level", default=settings.LOGGING["root"]["level"].lower(),
                            choices=["debug", "info", "warning", "error", "critical"])

    def handle(self, *args, **options) -> None:
        engine_args = engine_args_from_options(options)
        name = engine_args.served_model_name or engine_args.model
        logging.getLogger().setLevel(options["log_level"].upper())
        for logger_name in ("celery.app.trace", "celery.worker.strategy"):  # two lines per request otherwise
            logging.getLogger(logger_name).setLevel(max(logging.WARNING, logging.getLogger().level))
        runtime = WorkerRuntime(lambda: LLMEngine.from_engine_args(engine_args), name, settings.CELERY_BROKER_URL,
                                get_channel_layer(), engine_args.max_num_seqs)
        try:
            runtime.start()
        except TesseraError as error:
            raise CommandError(str(error)) from error
        install_runtime(runtime)
        worker_shutting_down.connect(lambda **_: runtime.begin_shutdown(), weak=False)
        worker = celery_app.Worker(
            hostname=f"tessera@{runtime.worker_id}", queues=[queue_for(name)], pool_cls="threads",
            concurrency=1, prefetch_multiplier=1, loglevel=options["log_level"].upper(),
            without_mingle=True, without_gossip=True, without_heartbeat=True, optimization="fair")
        try:
            worker.start()
        finally:
            runtime.close()
        if worker.exitcode:
            raise SystemExit(worker.exitcode)
