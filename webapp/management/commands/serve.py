"""``manage.py serve [MODEL] [flags]``: everything needed to serve a model on one machine.

Starts a private redis-server (unless ``REDIS_URL`` is set), ``--data-parallel-size``
engine workers and Daphne; Ctrl-C (or SIGTERM) stops them all. A worker that exits (its
engine failed, or it was killed) is started again, up to ``MAX_RESTARTS`` times per worker in
``RESTART_WINDOW`` seconds, and so are a Daphne process (accepting from the listening socket
serve keeps) and the private redis-server (their own ``MAX_RESTARTS``); past that, serve stops
everything rather than restart in a loop. Flags are vLLM's.
"""
from __future__ import annotations

import argparse
import ipaddress

import logging
import os
import signal
import socket
import time
import uuid
from urllib.parse import urlsplit

import redis
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from inference.errors import NotSupportedYetError, TesseraError
from tenants import shares as tenant_shares
from tenants.provisioning import apply_tenant_specs, check_total, parse_tenant_spec
from webapp import launcher
from webapp.catalog import lora
from webapp.api.tokenization import read_chat_template
from webapp.api.tool_parsers import TOOL_PARSERS
from webapp.env import DEVELOPMENT_SECRET_KEY, ServingEnv, parse_json_list
from webapp.serving import worker_slot
from webapp.cli import add_engine_arguments, add_worker_arguments, engine_argv, engine_args_from_options, worker_argv

logger = logging.getLogger("tessera.serve")

MAX_RESTARTS = 5  # restarts per worker (and per Daphne, and of Redis) allowed within RESTART_WINDOW seconds
RESTART_WINDOW = 600.0


def port_number(text: str) -> int:
    """argparse type of ``--port``: a TCP port, 1 to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port from 1 to 65535, got {text!r}")
    return port


def chat_template_option(text: str) -> str:
    """argparse type of ``--chat-template``: Jinja text, or a readable file (checked before anything starts; the
    web processes read the file themselves)."""
    try:
        read_chat_template(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--chat-template: ")) from None
    return text


def json_string_list(text: str) -> str:
    """argparse type of the CORS flags: a JSON list of strings, as vLLM takes them; passed on as that JSON
    (``TESSERA_ALLOWED_*``, read by :func:`webapp.env.json_list`)."""
    try:
        parse_json_list(text, "flag")  # an empty value too: it is not "allow all"
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, e.g. '[\"*\"]', got {text!r}") from None
    return text


def origin_list(text: str) -> str:
    """argparse type of ``--allowed-origins``: a JSON list whose items are ``*``, ``null`` or
    ``scheme://host[:port]`` (no path: a browser's Origin header never has one)."""
    for origin in parse_json_list(json_string_list(text), "flag"):
        parts = urlsplit(origin)
        if origin not in ("*", "null") and not (parts.scheme and parts.netloc and not parts.path
                                                and not parts.query and not parts.fragment):
            raise argparse.ArgumentTypeError(f"{origin!r} is not an origin: use scheme://host[:port], "
                                             f"e.g. https://app.example.com, or \"*\"")
    return text


def deployment_env(options: dict) -> dict[str, str]:
    """The keys and CORS settings given as flags, as the web processes read them (``webapp.env``); a flag not
    given leaves the environment's own value (a deployment's settings) in place."""
    values = {"TESSERA_API_KEY": options["api_key"], "TESSERA_KEY_ONLY": "1" if options["key_only"] else None,
              "TESSERA_ALLOWED_ORIGINS": options["allowed_origins"],
              "TESSERA_ALLOWED_METHODS": options["allowed_methods"],
              "TESSERA_ALLOWED_HEADERS": options["allowed_headers"],
              "TESSERA_ALLOW_CREDENTIALS": "1" if options["allow_credentials"] else None}
    return {name: value for name, value in values.items() if value}


class Command(BaseCommand):
    help = "Serve a model with an OpenAI-compatible API (Daphne + Celery engine workers + Redis)."

    def add_arguments(self, parser) -> None:
        add_engine_arguments(parser)
        add_worker_arguments(parser)
        parser.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
        parser.add_argument("--port", type=port_number, default=8000, help="Port to listen on (1-65535).")
        parser.add_argument("--chat-template", type=chat_template_option,
                            help="Chat template: a file, or the Jinja template itself.")
        parser.add_argument("--enable-auto-tool-choice", action="store_true",
                            help="Let the model decide when to call tools ('tool_choice': 'auto', the default "
                                 "when a request has 'tools'); needs --tool-call-parser.")
        parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                            help="How the model writes tool calls (hermes: Qwen2.5, Hermes and the packaged "
                                 "model's template; llama3_json; mistral; pythonic).")
        parser.add_argument("--api-key", help="Require 'Authorization: Bearer <key>' on /v1 endpoints "
                                              "(this key, or a tenant's key).")
        parser.add_argument("--key-only", action="store_true",
                            help="Every API request needs a valid key (a tenant's, or --api-key).")
        for flag, what, check in (("--allowed-origins", "origins", origin_list),
                                  ("--allowed-methods", "methods", json_string_list),
                                  ("--allowed-headers", "request headers", json_string_list)):
            parser.add_argument(flag, type=check, default=None, metavar="JSON",
                                help=f"CORS: the {what} browsers may use on the API, a JSON list such as "
                                     f"'[\"*\"]' (the default).")
        parser.add_argument("--allow-credentials", action="store_true",
                            help="CORS: allow credentials (cookies) on cross-origin API requests.")
        parser.add_argument("--tenant-id", action="append", default=[], metavar="SLUG=SHARE%",
                            help="Create or update a tenant with its GPU share, e.g. --tenant-id team1=30%% "
                                 "--tenant-id team2=70%% (repeatable).")
        parser.add_argument("--log-level", default="info",
                            choices=["debug", "info", "warning", "error", "critical"])
        parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                            help="Engine workers to start (each hosts one engine).")
        parser.add_argument("--api-server-count", type=int, default=None,
                            help="Web (Daphne) processes sharing the port; more keep up with more streamed "
                                 "tokens per second. Default: one per 4 CPU cores of a GPU host, at most 4; "
                                 "1 when the engines run on the CPU.")

    def handle(self, *args, **options) -> None:
        engine_args = engine_args_from_options(options)
        try:  # resolve the model and refuse flags whose feature does not exist yet, before starting anything
            engine_args.create_engine_config()
        except NotSupportedYetError as error:
            raise CommandError(f"not supported yet: {error}") from None
        except TesseraError as error:
            raise CommandError(str(error)) from None
        try:  # before loading anything: a server already on the port would answer our readiness check
            launcher.check_port_free(options["host"], options["port"])
        except OSError as error:
            raise CommandError(f"{error}. Is another server running there? Pick another --port.") from None
        launcher.DIE_WITH_PARENT = True
        if options["data_parallel_size"] < 1:
            raise CommandError("--data-parallel-size must be at least 1.")
        if options["api_server_count"] is None:
            options["api_server_count"] = default_api_server_count(engine_args.device)
        if not 1 <= options["api_server_count"] <= 64:
            raise CommandError(f"--api-server-count must be between 1 and 64, got {options['api_server_count']}.")
        if options["enable_auto_tool_choice"] and not options["tool_call_parser"]:
            raise CommandError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                               f"{', '.join(sorted(TOOL_PARSERS))}).")
        try:
            tenant_specs = [parse_tenant_spec(text) for text in options["tenant_id"]]
        except ValueError as error:
            raise CommandError(str(error)) from None
        public_key = ServingEnv.from_environ(os.environ).secret_key == DEVELOPMENT_SECRET_KEY
        if public_key and not _is_loopback(options["host"]):
            self.stderr.write(f"Warning: serving on {options['host']} with Django's public development secret key: "
                              "set DJANGO_SECRET_KEY (e.g. `python -c 'import secrets; "
                              "print(secrets.token_urlsafe(50))'`) so that sessions and CSRF tokens cannot be forged.")
        call_command("migrate", interactive=False, verbosity=0)
        from inference.lora.config import parse_lora_modules  # noqa: PLC0415
        clashes = lora.startup_clashes([engine_args.served_model_name or engine_args.model],
                                       [m.lora_name for m in parse_lora_modules(engine_args.lora_modules)])
        if clashes:
            raise CommandError(" ".join(clashes))
        try:
            check_total(tenant_specs)
        except ValueError as error:
            raise CommandError(str(error)) from None
        options["tenant_specs"] = tenant_specs
        options["deployment_env"] = deployment_env(options)
        web = ServingEnv.from_environ({**os.environ, **options["deployment_env"]})  # as the web processes read it
        if web.allow_credentials and "*" in web.allowed_origins:
            self.stderr.write("Warning: --allow-credentials with every origin allowed lets any website send requests "
                              "with the user's cookies and read the answers; list the origins (--allowed-origins).")
        children: list[launcher.Child] = []
        self.listener = None  # the web processes' listening socket, kept for a Daphne started in a dead one's place
        # Ctrl-C and SIGTERM both stop everything. SIGINT explicitly too: a shell starting serve in the
        # background without job control makes it ignore SIGINT, and Python then installs no handler.
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
        try:
            self._run(options, engine_args, children)
        except KeyboardInterrupt:
            self.stdout.write("Stopping...")
        finally:
            launcher.stop_all(children)  # web and workers together, Redis last
            if self.listener is not None:
                self.listener.close()
            shared_redis = os.environ.get("REDIS_URL")
            if shared_redis and getattr(self, "slots", None):  # a private Redis is gone with its records
                worker_slot.forget(redis.Redis.from_url(shared_redis, socket_timeout=5), self.slots)
            self.stdout.write("Stopped.")

    def _run(self, options: dict, engine_args, children: list[launcher.Child]) -> None:
        redis_url = os.environ.get("REDIS_URL")
        if not redis_url:
            redis_child, redis_url = launcher.start_redis()
            children.append(redis_child)
            self.stdout.write(f"Started a private redis-server at {redis_url}")
        tenant_shares.use_redis(redis_url)
        for tenant in apply_tenant_specs(options["tenant_specs"]):
            state = "" if tenant.active else " (inactive: switched off in the admin; --tenant-id does not reactivate it)"
            self.stdout.write(f"Tenant '{tenant.slug}': GPU share {tenant.gpu_share}%{state}")
        tenant_shares.publish()
        lora.publish()  # the adapters registered in the database, for the workers
        name = engine_args.served_model_name or engine_args.model
        env = launcher.child_env(
            REDIS_URL=redis_url, TESSERA_MODEL=engine_args.model, TESSERA_SERVED_MODEL_NAME=name,
            TESSERA_TOKENIZER=engine_args.tokenizer, TESSERA_CHAT_TEMPLATE=options["chat_template"],
            TESSERA_TOOL_CALL_PARSER=options["tool_call_parser"],
            TESSERA_ENABLE_AUTO_TOOL_CHOICE="1" if options["enable_auto_tool_choice"] else None,
            TESSERA_LOG_LEVEL=options["log_level"].upper(), **options["deployment_env"],
            OMP_NUM_THREADS=cpu_threads_per_worker(engine_args.device, options["data_parallel_size"]))
        run = uuid.uuid4().hex[:12]  # slots of this run only: a new run starts with its flags (worker_slot)
        self.slots = [f"{socket.gethostname()}-{run}-{index}" for index in range(options["data_parallel_size"])]
        for slot in self.slots:  # a slot each: a restart in it resumes its model
            children.append(launcher.start_worker(engine_argv(engine_args) + worker_argv(options),
                                                  {**env, "TESSERA_WORKER_SLOT": slot}))
        web_children, self.listener = launcher.start_web(options["host"], options["port"], env,
                                                         count=options["api_server_count"])
        children.extend(web_children)
        host = "127.0.0.1" if options["host"] in ("0.0.0.0", "::") else options["host"]
        base_url = f"http://{host}:{options['port']}"
        try:
            launcher.wait_until_live(base_url, timeout=600, children=children)
        except RuntimeError as error:
            raise CommandError(f"the server did not start: {error}") from None
        self.stdout.write(self.style.SUCCESS(f"Tessera serves '{name}' at {base_url}/v1 (Ctrl-C stops)"))
        # a budget each: one's crashes spare the others
        restarts: dict[str, list[float]] = {"worker": [], "daphne": [], "redis": []}
        while True:
            for i, child in enumerate(children):
                if child.alive():
                    continue
                if child.name not in restarts:
                    raise CommandError(f"{child.name} exited with code {child.proc.returncode}; stopping.")
                recent = restarts[child.name] = [t for t in restarts[child.name] if time.monotonic() - t < RESTART_WINDOW]
                limit = MAX_RESTARTS * {"worker": options["data_parallel_size"],
                                        "daphne": options["api_server_count"]}.get(child.name, 1)
                if len(recent) >= limit:
                    raise CommandError(f"{child.name} exited with code {child.proc.returncode}, more than {limit} "
                                       f"restarts in {RESTART_WINDOW / 60:.0f} minutes; stopping.")
                recent.append(time.monotonic())
                if child.name == "redis":
                    children[i] = self._restart_redis(child, redis_url)
                    continue
                if child.name == "daphne":
                    self.stderr.write(f"A web process (Daphne) exited with code {child.proc.returncode}; starting a "
                                      "new one on the same socket (its requests in flight were lost).")
                    children[i] = launcher.start_daphne(options["host"], options["port"], child.env,
                                                        fd=self.listener.fileno())
                    continue
                self.stderr.write(f"A worker exited with code {child.proc.returncode}; starting a new one, which "
                                  "serves the model it served.")
                children[i] = launcher.start_worker(engine_argv(engine_args) + worker_argv(options), child.env)
            time.sleep(0.5)


    def _restart_redis(self, child: launcher.Child, redis_url: str) -> launcher.Child:
        """The private redis-server died: start a new one on the same port and publish the tenants'
        shares to it again. Its data is gone; the web processes enqueue again the requests that no
        worker had started, and streams whose messages were lost end with an error event
        (:mod:`webapp.serving.client`)."""
        self.stderr.write(f"redis-server exited with code {child.proc.returncode}; starting a new one (requests "
                          "in flight are enqueued again or ended with an error).")
        port = int(redis_url.rsplit(":", 1)[1].split("/", 1)[0])
        try:
            new, _ = launcher.start_redis(port=port)
        except RuntimeError as error:
            raise CommandError(f"redis-server could not be restarted: {error}; stopping.") from None
        tenant_shares.publish()
        lora.publish()
        return new


MAX_DEFAULT_API_SERVERS = 4


def default_api_server_count(device: str | None, cores: int | None = None, gpu: bool | None = None) -> int:
    """``--api-server-count`` when not given: with GPU engines, one web process per 4 CPU cores, at
    most ``MAX_DEFAULT_API_SERVERS`` (on the H200, W1 through the serving path reached 70% of the
    offline engine with one process and 94% with four: one Daphne process cannot stream tens of
    thousands of tokens a second); with CPU engines 1, since the web processes would take the
    cores the engine computes on."""
    if gpu is None:
        import torch

        gpu = (device or "").startswith("cuda") or (device is None and torch.cuda.is_available())
    if not gpu:
        return 1
    return max(1, min(MAX_DEFAULT_API_SERVERS, (cores or os.cpu_count() or 1) // 4))


def cpu_threads_per_worker(device: str | None, workers: int, cores: int | None = None) -> str | None:
    """``OMP_NUM_THREADS`` for each of ``workers`` CPU engines on this host: the cores split between
    them, so that they do not all spin threads on every core (two workers on two cores served a
    tenth of one worker's tokens). None (the environment as it is) for one worker, a GPU engine, or
    when ``OMP_NUM_THREADS`` is set already."""
    import torch

    on_cpu = device == "cpu" or (device is None and not torch.cuda.is_available())
    if workers <= 1 or not on_cpu or os.environ.get("OMP_NUM_THREADS"):
        return os.environ.get("OMP_NUM_THREADS")
    return str(max(1, (cores or os.cpu_count() or 1) // workers))


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback: 127.0.0.0/8, ::1, localhost."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
