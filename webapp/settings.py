"""Django settings; every deployment-specific value comes from :mod:`webapp.env`."""
from __future__ import annotations

from .env import BASE_DIR, ENV

SECRET_KEY = ENV.secret_key
DEBUG = ENV.debug
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "corsheaders",
    "tenants",
    "dashboard",
    "webapp",
    "webapp.catalog",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

# The API needs none of the above; each would cost two thread hops per request under ASGI
# (see webapp/handlers.py). Only /admin/, /tenants/, /dashboard/ and /static/ go through MIDDLEWARE.
# Cross-origin requests from browser apps (django-cors-headers; async, so no thread hop): the API only,
# as vLLM's --allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials, default all.
API_MIDDLEWARE: list[str] = ["corsheaders.middleware.CorsMiddleware"]
CORS_ALLOW_ALL_ORIGINS = "*" in ENV.allowed_origins
CORS_ALLOWED_ORIGINS = [origin for origin in ENV.allowed_origins if origin != "*"]
CORS_ALLOW_METHODS = (["DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT"] if "*" in ENV.allowed_methods
                      else list(ENV.allowed_methods))
# A "*" in Access-Control-Allow-Headers does not cover Authorization (the Fetch standard): it is named too.
# An explicit list gets the CORS-safelisted headers too (Content-Type: a JSON POST), as Starlette's (vLLM's).
CORS_ALLOW_HEADERS = (["*", "authorization"] if "*" in ENV.allowed_headers else list(dict.fromkeys(
    [*ENV.allowed_headers, "accept", "accept-language", "content-language", "content-type"])))
CORS_ALLOW_CREDENTIALS = ENV.allow_credentials

ROOT_URLCONF = "webapp.urls"
ASGI_APPLICATION = "webapp.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": ENV.db_path,
        "OPTIONS": {"timeout": 20},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

LOGIN_URL = "tenants:login"  # the tenant pages' login (the admin has its own)
LOGIN_REDIRECT_URL = "/tenants/"  # after a login that names no next page

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]

# Prompts can be long: allow request bodies up to 32 MiB.
DATA_UPLOAD_MAX_MEMORY_SIZE = 32 * 1024 * 1024

# Channels: one Redis-backed layer. Every reply channel of a web process shares one
# Redis key, so the capacity must cover all of that process's streams at once.
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # The layer blocks 5 s in BZPOPMIN, so the socket timeout must be longer; and it
        # cleans up after every received message on a connection of its own, so hundreds
        # of streams need more than redis-py's default 100 connections.
        "CONFIG": {"hosts": [{"address": ENV.redis_url, "socket_timeout": 30, "max_connections": 10_000}],
                   "capacity": 100_000, "expiry": 60},
    }
}

# Celery (see webapp/celery.py): the broker is Redis; tasks are handed to an engine.
CELERY_BROKER_URL = ENV.redis_url
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# A worker acknowledges a request only once its engine has taken it, and reserves one
# message at a time: requests not yet taken stay in Redis for any worker of the model.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# A message reserved by a worker that died is put back after this many seconds.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": 20,
    "unacked_restore_interval": 2,
    "unacked_restore_throttle": 1,
}
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

TESSERA = {
    "MODEL": ENV.model,
    "SERVED_MODEL_NAME": ENV.served_model_name,
    "TOKENIZER": ENV.tokenizer,
    "CHAT_TEMPLATE": ENV.chat_template,
    "TOOL_CALL_PARSER": ENV.tool_call_parser,
    "ENABLE_AUTO_TOOL_CHOICE": ENV.enable_auto_tool_choice,
    "API_KEY": ENV.api_key,
    "KEY_ONLY": ENV.key_only,
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": ENV.log_level},
    "loggers": {"django.request": {"level": "CRITICAL"}},  # the API logs its own errors
}
