"""The real serving stack for tests: redis-server on a free port, Celery engine
workers with the packaged SmolLM2, and Daphne serving the ASGI app. No mocks."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import redis

from webapp import launcher

MODEL = "smollm2-135m-instruct"
# Small KV pool and context keep worker start-up short on CPU.
ENGINE_ARGV = [MODEL, "--max-model-len", "2048", "--kv-cache-space", "0.25"]


class Stack:
    """One Redis, some engine workers and one Daphne; each process logs to ``logs_dir``."""

    def __init__(self, logs_dir: Path, num_workers: int = 1, engine_argv: list[str] = ENGINE_ARGV,
                 redis_url: str | None = None, **env: str | None) -> None:
        self.logs_dir = logs_dir
        logs_dir.mkdir(parents=True, exist_ok=True)
        self.redis_child = None
        if redis_url is None:
            self.redis_child, redis_url = launcher.start_redis(log_path=str(logs_dir / "redis.log"))
        self.redis_url = redis_url
        self.redis = redis.Redis.from_url(redis_url)
        self.engine_argv = engine_argv
        self.env = launcher.child_env(**{"REDIS_URL": redis_url, "TESSERA_MODEL": MODEL, "TESSERA_LOG_LEVEL": "INFO",
                                         "TESSERA_DB_PATH": str(logs_dir / "db.sqlite3"), **env})
        subprocess.run([sys.executable, launcher.MANAGE, "migrate", "--noinput", "-v", "0"], env=self.env,
                       check=True, cwd=launcher.BASE_DIR)
        self.workers: list[launcher.Child] = []
        for _ in range(num_workers):
            self.add_worker()
        self.port = launcher.free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.daphne = launcher.start_daphne("127.0.0.1", self.port, self.env,
                                            log_path=str(logs_dir / "daphne.log"))
        if num_workers:
            self.wait_live()
        else:
            self.wait_web()

    def add_worker(self) -> launcher.Child:
        log = self.logs_dir / f"worker{len(self.workers)}.log"
        child = launcher.start_worker(self.engine_argv, self.env, log_path=str(log))
        self.workers.append(child)
        return child

    def wait_live(self, timeout: float = 300) -> None:
        launcher.wait_until_live(self.base_url, timeout, [self.daphne, *[w for w in self.workers if w.alive()]])

    def wait_web(self, timeout: float = 60) -> None:
        """Wait until Daphne answers (without needing a worker)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if http("GET", self.base_url + "/version", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            assert self.daphne.alive() and time.monotonic() < deadline, "daphne did not start"
            time.sleep(0.1)

    def queued(self) -> int:
        """Requests waiting in Redis for a worker of the model (every tenant's queue)."""
        return sum(self.redis.llen(key) for key in self.redis.scan_iter(match=f"tessera:queue:{MODEL}:*"))

    def worker_infos(self) -> list[dict]:
        """Heartbeat info of the live workers (engine stats included)."""
        ids = self.redis.zrangebyscore("tessera:workers", time.time() - 4, "+inf")
        raw = self.redis.mget([f"tessera:worker:{i.decode()}" for i in ids]) if ids else []
        return [json.loads(r) for r in raw if r]

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=kwargs.pop("api_key", "unused"),
                             max_retries=0, **kwargs)

    def stop(self) -> None:
        self.daphne.stop()
        for worker in self.workers:
            worker.stop()
        if self.redis_child:
            self.redis_child.stop()


def http(method: str, url: str, body: bytes | dict | None = None, headers: dict | None = None,
         timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    """A plain HTTP request; returns (status, headers, body) also for error statuses."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream, in order."""
    return [line[6:] for line in raw.decode("utf-8").split("\n") if line.startswith("data: ")]


def metrics_text(base_url: str) -> str:
    """The body of ``GET /metrics`` (checked to be Prometheus text)."""
    status, headers, body = http("GET", base_url + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    return body.decode()


def metric_value(text: str, prefix: str) -> float:
    """The sum of the samples whose line starts with ``prefix`` (0 when there is none)."""
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))
