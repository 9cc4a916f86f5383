"""The one place that reads Tessera's environment variables (typed, read once).

``manage.py serve`` sets these for the processes it starts (Daphne and the engine
worker); a deployment sets them itself.

=============================  ==============================================================
``REDIS_URL``                  Celery broker, Channels layer and live-metrics store.
``TESSERA_MODEL``              model to serve (a packaged name, a path or a GGUF file).
``TESSERA_SERVED_MODEL_NAME``  name clients put in ``"model"`` (default: ``TESSERA_MODEL``).
``TESSERA_TOKENIZER``          tokenizer source when it differs from the model.
``TESSERA_CHAT_TEMPLATE``      Jinja chat template, or a path to a file holding one.
``TESSERA_TOOL_CALL_PARSER``   tool-call format of the model's output (``--tool-call-parser``).
``TESSERA_ENABLE_AUTO_TOOL_CHOICE`` ``1``: ``tool_choice: "auto"`` is served (``--enable-auto-tool-choice``).
``TESSERA_API_KEY``            when set, requests need ``Authorization: Bearer <key>``.
``TESSERA_KEY_ONLY``           ``1``: every API request needs a valid key (tenant or deployment).
``TESSERA_SHARE_PREFIX_CACHE`` ``1``: tenants share cached prompt prefixes (default: a salt per tenant).
``TESSERA_ALLOW_RUNTIME_LORA_UPDATING`` ``1``: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` are served.
``TESSERA_ALLOWED_ORIGINS``    CORS: JSON list of origins browsers may call the API from (default ``["*"]``).
``TESSERA_ALLOWED_METHODS``    CORS: JSON list of methods (default ``["*"]``).
``TESSERA_ALLOWED_HEADERS``    CORS: JSON list of request headers (default ``["*"]``).
``TESSERA_ALLOW_CREDENTIALS``  CORS: ``1`` allows credentials (cookies) on cross-origin requests.
``TESSERA_DB_PATH``            SQLite database file (default ``db.sqlite3`` in the repository).
``TESSERA_LOG_LEVEL``          log level name (default ``INFO``).
``DJANGO_SECRET_KEY``          Django's secret key (a fixed development key otherwise).
``DJANGO_DEBUG``               ``1`` turns on Django's debug mode.
=============================  ==============================================================
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ServingEnv:
    """Environment-derived settings of the web and worker processes."""

    redis_url: str
    model: str
    served_model_name: str
    tokenizer: str | None
    chat_template: str | None
    tool_call_parser: str | None
    enable_auto_tool_choice: bool
    api_key: str | None
    key_only: bool
    share_prefix_cache: bool
    allow_runtime_lora_updating: bool
    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...]
    allowed_headers: tuple[str, ...]
    allow_credentials: bool
    db_path: Path
    log_level: str
    secret_key: str
    debug: bool

    @classmethod
    def from_environ(cls, environ: os._Environ | dict[str, str] = os.environ) -> "ServingEnv":
        model = environ.get("TESSERA_MODEL") or DEFAULT_MODEL
        return cls(
            redis_url=environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0",
            model=model,
            served_model_name=environ.get("TESSERA_SERVED_MODEL_NAME") or model,
            tokenizer=environ.get("TESSERA_TOKENIZER") or None,
            chat_template=environ.get("TESSERA_CHAT_TEMPLATE") or None,
            tool_call_parser=environ.get("TESSERA_TOOL_CALL_PARSER") or None,
            enable_auto_tool_choice=environ.get("TESSERA_ENABLE_AUTO_TOOL_CHOICE", "") in ("1", "true", "True"),
            api_key=environ.get("TESSERA_API_KEY") or None,
            key_only=environ.get("TESSERA_KEY_ONLY", "") in ("1", "true", "True"),
            share_prefix_cache=environ.get("TESSERA_SHARE_PREFIX_CACHE", "") in ("1", "true", "True"),
            allow_runtime_lora_updating=environ.get("TESSERA_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
            allowed_origins=json_list(environ, "TESSERA_ALLOWED_ORIGINS"),
            allowed_methods=json_list(environ, "TESSERA_ALLOWED_METHODS"),
            allowed_headers=json_list(environ, "TESSERA_ALLOWED_HEADERS"),
            allow_credentials=environ.get("TESSERA_ALLOW_CREDENTIALS", "") in ("1", "true", "True"),
            db_path=Path(environ.get("TESSERA_DB_PATH") or BASE_DIR / "db.sqlite3"),
            log_level=(environ.get("TESSERA_LOG_LEVEL") or "INFO").upper(),
            secret_key=environ.get("DJANGO_SECRET_KEY") or DEVELOPMENT_SECRET_KEY,
            debug=environ.get("DJANGO_DEBUG", "") in ("1", "true", "True"),
        )


DEVELOPMENT_SECRET_KEY = "tessera-development-key-change-me-in-production"  # public: in this repository


def json_list(environ, name: str, default: tuple[str, ...] = ("*",)) -> tuple[str, ...]:
    """:func:`parse_json_list` of ``environ[name]`` (vLLM's form of ``--allowed-origins``), or ``default`` when
    it is unset or empty.

    Raises:
        ValueError: the variable is not a JSON list of strings (the message names it).
    """
    raw = environ.get(name)
    return parse_json_list(raw, name) if raw else default


def parse_json_list(raw: str, name: str) -> tuple[str, ...]:
    """The strings of the JSON list ``raw``.

    Raises:
        ValueError: ``raw`` is not a JSON list of strings (the message names ``name``).
    """
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"{name} must be a JSON list of strings, e.g. '[\"*\"]': {error}") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{name} must be a JSON list of strings, e.g. '[\"*\"]', got {raw[:200]!r}")
    return tuple(value)


ENV = ServingEnv.from_environ()
