"""Start and stop the processes of a Tessera server: redis-server, engine workers, Daphne.

Used by ``manage.py serve`` and by the tests, so both run the stack the same way. Every
child gets its own session (process group): a terminal's Ctrl-C reaches only ``serve``,
which then stops the children in order (web, workers, Redis) and leaves none behind.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import redis

BASE_DIR = Path(__file__).resolve().parent.parent
MANAGE = str(BASE_DIR / "manage.py")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DIE_WITH_PARENT = False  # set by ``manage.py serve``: children get SIGTERM when serve dies, even by SIGKILL


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux)
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Child:
    """A child process started in its own session, stopped with SIGTERM then SIGKILL.

    With ``DIE_WITH_PARENT`` (Linux) the kernel also sends it SIGTERM when the process that
    started it dies, so a ``kill -9`` of ``serve`` leaves no server running on.
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None,
                 log_path: str | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        self.name = name
        self.argv = argv
        self.env = env  # what it was started with (a restart in its place reuses it)
        self._log = open(log_path, "ab") if log_path else None
        preexec = _die_with_parent if DIE_WITH_PARENT and sys.platform.startswith("linux") else None
        self.proc = subprocess.Popen(argv, env=env, cwd=BASE_DIR, start_new_session=True, pass_fds=pass_fds,
                                     preexec_fn=preexec, stdout=self._log,
                                     stderr=subprocess.STDOUT if self._log else None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the process (as a crash would)."""
        if self.alive():
            self.proc.kill()
        self.proc.wait()

    def stop(self, timeout: float = 15.0, sig: int = signal.SIGTERM) -> int:
        """Ask the process to stop, wait up to ``timeout`` seconds, then kill it; returns its exit code."""
        if self.alive():
            self.proc.send_signal(sig)
        return self._reap(timeout)

    def _reap(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the process to end, then kill it; close its log."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._log:
            self._log.close()
        return self.proc.returncode


def stop_all(children: list[Child], timeout: float = 15.0) -> None:
    """Stop ``children`` together: all but Redis get SIGTERM at once and share one ``timeout`` (then
    SIGKILL), so that several web processes and workers take one grace period, not one each; Redis,
    which the workers use while they stop, goes last."""
    first = [child for child in children if child.name != "redis"]
    for child in first:
        if child.alive():
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in first:
        child._reap(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.name == "redis":
            child.stop(timeout)


def start_redis(port: int | None = None, log_path: str | None = None) -> tuple[Child, str]:
    """A private redis-server on 127.0.0.1 (no persistence); returns it and its URL.

    Raises:
        RuntimeError: redis-server is not installed or does not answer within 10 s.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install -y redis-server), "
                           "and REDIS_URL is not set.")
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="tessera-redis-")
    child = Child("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no", "--dir", workdir, "--loglevel", "warning"], log_path=log_path)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return child, url
        except redis.ConnectionError:
            if time.monotonic() > deadline or not child.alive():
                child.stop()
                raise RuntimeError(f"redis-server did not start on port {port}") from None
            time.sleep(0.05)


def start_worker(engine_argv: list[str], env: dict[str, str], log_path: str | None = None) -> Child:
    """An engine worker: ``manage.py worker`` with the engine flags."""
    return Child("worker", [sys.executable, MANAGE, "worker", *engine_argv], env=env, log_path=log_path)


def start_daphne(host: str, port: int, env: dict[str, str], log_path: str | None = None,
                 fd: int | None = None) -> Child:
    """Daphne serving the ASGI app on ``host:port``, or accepting from the listening socket ``fd``."""
    where = ["--fd", str(fd)] if fd is not None else ["-b", host, "-p", str(port)]
    return Child("daphne", [sys.executable, "-m", "daphne", *where, "--proxy-headers", "webapp.asgi:application"],
                 env=env, log_path=log_path, pass_fds=(fd,) if fd is not None else ())


def start_web(host: str, port: int, env: dict[str, str], count: int = 1) -> tuple[list[Child], socket.socket]:
    """``count`` Daphne processes serving ``host:port``; returns them and the listening socket.

    This process binds the listening socket and each Daphne accepts from it (``--fd``); the kernel spreads
    connections over them, like vLLM's ``--api-server-count``. The caller keeps the socket open while it serves:
    a Daphne started in place of a dead one accepts from it too (:func:`start_daphne` with its ``fileno()``), and
    connections that arrive meanwhile wait in its backlog instead of being refused. Each web process has its own
    reply router; limits and metrics live in Redis, so they hold across processes.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=4096)
    try:
        return [start_daphne(host, port, env, fd=listener.fileno()) for _ in range(count)], listener
    except BaseException:
        listener.close()
        raise


def check_port_free(host: str, port: int) -> None:
    """Raises OSError (with the address) when ``host:port`` cannot be listened on now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.create_server((host, port), family=family).close()
    except OSError as error:
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def wait_until_live(base_url: str, timeout: float, children: list[Child] = ()) -> None:
    """Wait for ``GET /health`` to answer 200 (an engine worker is live).

    Raises:
        RuntimeError: a child exited, or ``timeout`` seconds passed.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in children:
            if not child.alive():
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {base_url} did not become live within {timeout:.0f} s")


def child_env(**values: str | None) -> dict[str, str]:
    """This process's environment plus ``values`` (None removes a variable)."""
    env = dict(os.environ)
    for key, value in values.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env
