"""``manage.py serve``: one command starts Redis, a worker and Daphne; Ctrl-C stops them all,
and flags of features not built yet stop it with a clear message."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.webapp.serving_stack import MODEL
from webapp import launcher


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of every descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                try:
                    found[child] = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                frontier.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def _start_serve(tmp_path, port: int, *flags: str) -> tuple[subprocess.Popen, object]:
    """``manage.py serve`` on ``port`` with a private database; returns it (and its log file) once it
    printed that it serves."""
    env = launcher.child_env(REDIS_URL=None, TESSERA_DB_PATH=str(tmp_path / "db.sqlite3"))
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen([sys.executable, launcher.MANAGE, "serve", "--port", str(port), "--log-level", "warning",
                              *flags], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=launcher.BASE_DIR)
    deadline = time.monotonic() + 300
    while b"Tessera serves" not in (tmp_path / "serve.log").read_bytes():
        if serve.poll() is not None or time.monotonic() > deadline:
            serve.kill()
            log.close()
            raise AssertionError((tmp_path / "serve.log").read_text())
        time.sleep(0.2)
    return serve, log


def test_serve_starts_everything_and_ctrl_c_stops_everything(tmp_path):
    port = launcher.free_port()
    serve, log = _start_serve(tmp_path, port, "--max-model-len", "2048", "--kv-cache-space", "0.25",
                              "--tenant-id", "team1=30%", "--tenant-id", "team2=70%", "--api-server-count", "2")
    try:
        children = _children(serve.pid)
        commands = " | ".join(children.values())
        assert "redis-server" in commands and " worker " in commands, commands
        assert sum("daphne" in c for c in children.values()) == 2, commands  # --api-server-count 2

        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4)
        assert reply.usage.completion_tokens >= 1
        # --tenant-id created the tenants, and the running worker has their shares.
        reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_headers={"X-Tenant-ID": "team1"})
        assert reply.usage.completion_tokens >= 1
        redis_url = re.search(rb"private redis-server at (\S+)", (tmp_path / "serve.log").read_bytes())[1].decode()
        client = redis.Redis.from_url(redis_url)
        (worker,) = [json.loads(client.get(f"tessera:worker:{w.decode()}")) for w in client.zrange("tessera:workers", 0, -1)]
        assert worker["tenant_shares"] == {"default": 0.0, "team1": 30.0, "team2": 70.0}

        # Its private Redis dies: serve starts a new one on the same address, publishes the tenants'
        # shares to it again, and the server answers as before.
        (redis_pid,) = [pid for pid, cmd in children.items() if "redis-server" in cmd]
        os.kill(redis_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            try:
                ids = client.zrange("tessera:workers", 0, -1)
                infos = [json.loads(raw) for raw in client.mget([f"tessera:worker:{w.decode()}" for w in ids]) if raw]
                if infos and infos[0].get("tenant_shares", {}).get("team1") == 30.0:
                    break
            except redis.RedisError:
                pass
            assert time.monotonic() < deadline and serve.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        assert b"redis-server exited" in (tmp_path / "serve.log").read_bytes()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_headers={"X-Tenant-ID": "team1"})
        assert reply.usage.completion_tokens >= 1

        # Both web processes die: serve starts new ones on the socket it kept, and the port answers again.
        daphnes = [pid for pid, cmd in _children(serve.pid).items() if "daphne" in cmd]
        for pid in daphnes:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while sum(b"A web process (Daphne) exited" in line for line in (tmp_path / "serve.log").read_bytes()
                  .splitlines()) < 2:
            assert time.monotonic() < deadline and serve.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert reply.usage.completion_tokens >= 1
        new = [pid for pid, cmd in _children(serve.pid).items() if "daphne" in cmd]
        assert len(new) == 2 and not set(new) & set(daphnes), (daphnes, new)

        children = _children(serve.pid)
        serve.send_signal(signal.SIGINT)  # what Ctrl-C delivers
        assert serve.wait(60) == 0
        time.sleep(0.2)
        left = {pid: cmd for pid, cmd in children.items() if _alive(pid)}
        assert not left, left
    finally:
        if serve.poll() is None:
            serve.kill()
        log.close()


@pytest.mark.parametrize("flag, message", [
    (["--tensor-parallel-size", "2"], "tensor_parallel_size=2 does not divide smollm2-135m-instruct's 9 attention "
                                      "heads; valid sizes: 1, 3, 9."),
    (["--quantization", "awq"], "needs an AWQ checkpoint"),  # the packaged model is not AWQ-quantized
    # FP8 now runs under tensor parallelism; on this CPU machine it still names its hardware requirement.
    (["--tensor-parallel-size", "3", "--quantization", "fp8"], "quantization='fp8' needs a GPU with FP8 tensor cores"),
    (["--port", "99999"], "must be a TCP port from 1 to 65535"),
    (["--max-model-len", "-5"], "max_model_len must be at least 1 token, got -5"),
    (["--kv-cache-space", "-1"], "kv_cache_space must be a positive number of GiB"),
    (["--allowed-origins", "https://app.example.com"], "--allowed-origins: must be a JSON list of strings"),
    (["--allowed-origins", ""], "--allowed-origins: must be a JSON list of strings"),  # not "allow all"
    (["--allowed-origins", '["https://app.example.com/chat"]'], "'https://app.example.com/chat' is not an origin"),
    (["--allowed-headers", '["x-tenant-id", 3]'], "--allowed-headers: must be a JSON list of strings"),
    # a mistyped template file would otherwise become the template text: every chat prompt the path itself
    (["--chat-template", "/etc/tessera/chat.jinja"], "'/etc/tessera/chat.jinja' is not a readable file"),
])
def test_flags_the_model_cannot_use_stop_serve_before_it_starts(tmp_path, flag, message):
    env = launcher.child_env(REDIS_URL=None, TESSERA_DB_PATH=str(tmp_path / "db.sqlite3"))
    done = subprocess.run([sys.executable, launcher.MANAGE, "serve", *flag], env=env, capture_output=True,
                          text=True, timeout=120, cwd=launcher.BASE_DIR)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
    assert "Started" not in done.stdout


@pytest.mark.parametrize("values, message", [
    (["team1=130%"], "whole percentage from 0 to 100"),
    (["team1"], "expected SLUG=SHARE%, e.g. team1=30% (the GPU share is required"),  # no silent tenant
    (["team1=30%", "team1=20%"], "'team1' is given twice"),  # not the last one silently
    (["team1=", "team2=30%"], "expected SLUG=SHARE%"),
    (["team one=30%"], "only letters, digits"),
    (["team1=60%", "team2=50%"], "add up to 110%"),
])
def test_bad_tenant_shares_stop_serve_before_it_starts(tmp_path, values, message):
    env = launcher.child_env(REDIS_URL=None, TESSERA_DB_PATH=str(tmp_path / "db.sqlite3"))
    flags = [arg for value in values for arg in ("--tenant-id", value)]
    done = subprocess.run([sys.executable, launcher.MANAGE, "serve", "--port", str(launcher.free_port()), *flags],
                          env=env, capture_output=True,
                          text=True, timeout=120, cwd=launcher.BASE_DIR)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
    assert "Started" not in done.stdout


def test_serving_beyond_loopback_with_the_development_secret_key_warns(tmp_path):
    env = launcher.child_env(REDIS_URL=None, TESSERA_DB_PATH=str(tmp_path / "db.sqlite3"))
    env.pop("DJANGO_SECRET_KEY", None)
    flags = ["--tenant-id", "team1=60%", "--tenant-id", "team2=50%"]  # stops it right after the warning
    for host, warned in (("0.0.0.0", True), ("127.0.0.1", False)):
        done = subprocess.run([sys.executable, launcher.MANAGE, "serve", "--host", host, "--port",
                               str(launcher.free_port()), *flags], env=env, capture_output=True, text=True,
                              timeout=120, cwd=launcher.BASE_DIR)
        assert done.returncode != 0 and "add up to 110%" in done.stderr, done.stderr
        assert ("set DJANGO_SECRET_KEY" in done.stderr) == warned, done.stderr


def test_busy_port_stops_serve_before_it_loads_anything(tmp_path):
    import socket

    env = launcher.child_env(REDIS_URL=None, TESSERA_DB_PATH=str(tmp_path / "db.sqlite3"))
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, launcher.MANAGE, "serve", "--port", str(port)], env=env,
                              capture_output=True, text=True, timeout=120, cwd=launcher.BASE_DIR)
    assert done.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "Started" not in done.stdout


def test_killing_serve_with_sigkill_leaves_no_server_running(tmp_path):
    serve, log = _start_serve(tmp_path, launcher.free_port(), "--max-model-len", "512", "--kv-cache-space", "0.1")
    try:
        children = _children(serve.pid)
        assert len(children) >= 3, children
        serve.kill()  # no chance to stop its children itself
        serve.wait()
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in children):
            assert time.monotonic() < deadline, {pid: cmd for pid, cmd in children.items() if _alive(pid)}
            time.sleep(0.2)
    finally:
        if serve.poll() is None:
            serve.kill()
        for pid in children if "children" in locals() else ():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()


def test_cpu_workers_of_one_serve_split_the_cores(monkeypatch):
    """``-dp N`` on a CPU host: each worker gets cores // N threads (they were all spinning on every
    core: 5.8 tok/s with two workers on two cores, 70 once split); one worker or a GPU keeps the default."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()
    from webapp.management.commands.serve import cpu_threads_per_worker

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads_per_worker("cpu", 2, cores=2) == "1"
    assert cpu_threads_per_worker("cpu", 3, cores=16) == "5"
    assert cpu_threads_per_worker("cpu", 1, cores=16) is None
    assert cpu_threads_per_worker("cuda", 2, cores=16) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the operator's setting wins
    assert cpu_threads_per_worker("cpu", 2, cores=16) == "4"


def test_the_default_number_of_web_processes_comes_from_the_machine():
    """Without ``--api-server-count``: one Daphne process per 4 cores of a GPU host, at most 4 (one
    process streamed 70% of the offline engine's W1 tokens on the H200, four 94-97%); with CPU
    engines one, as the web processes would take the engine's cores."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()
    from webapp.management.commands.serve import default_api_server_count

    assert default_api_server_count("cuda", cores=16, gpu=True) == 4
    assert default_api_server_count("cuda", cores=128, gpu=True) == 4
    assert default_api_server_count("cuda", cores=8, gpu=True) == 2
    assert default_api_server_count("cuda", cores=2, gpu=True) == 1
    assert default_api_server_count("cpu", cores=16, gpu=False) == 1
    assert default_api_server_count("cpu", cores=16) == 1  # a CPU engine, whatever the host has


def test_registered_adapters_named_like_the_served_model_or_a_startup_adapter_stop_serve(tmp_path):
    """A registered adapter named like the served model would take its requests; one named like a `--lora-modules`
    adapter would be listed as one and served as the other: serve refuses to start, naming both and the owner."""
    env = launcher.child_env(REDIS_URL=None, TESSERA_DB_PATH=str(tmp_path / "db.sqlite3"))
    setup = ("from tenants.models import Tenant; from webapp.catalog.models import LoRAAdapter; "
             "LoRAAdapter.objects.create(name='sql', base_model='smollm2-135m-instruct', path='/adapters/sql', "
             "tenant=Tenant.objects.create(slug='team-x', name='team-x')); "
             "LoRAAdapter.objects.create(name='smollm2-135m-instruct', base_model='smollm2-135m-instruct', "
             "path='/adapters/m')")  # as an add while Redis was down could once leave it
    for args in (["migrate", "-v0"], ["shell", "-c", setup]):
        made = subprocess.run([sys.executable, launcher.MANAGE, *args], env=env, capture_output=True, text=True,
                              timeout=120, cwd=launcher.BASE_DIR)
        assert made.returncode == 0, made.stderr
    shares = ["--tenant-id", "team1=60%", "--tenant-id", "team2=50%"]  # stops serve once past the clash check
    for flags, clash in ((["--lora-modules", "sql=/adapters/other"], True),
                         (["--served-model-name", "chat", "--lora-modules", "docs=/adapters/docs"], False)):
        done = subprocess.run([sys.executable, launcher.MANAGE, "serve", "--port", str(launcher.free_port()),
                               "--enable-lora", *flags, *shares], env=env, capture_output=True, text=True,
                              timeout=120, cwd=launcher.BASE_DIR)
        assert done.returncode != 0, done.stderr
        if clash:
            assert "a --lora-modules adapter 'sql' has the name of a registered LoRA adapter (tenant 'team-x'" \
                in done.stderr, done.stderr
            assert ("the served model 'smollm2-135m-instruct' has the name of a registered LoRA adapter (public"
                    in done.stderr), done.stderr
        else:
            assert "add up to 110%" in done.stderr and "registered LoRA adapter" not in done.stderr, done.stderr


def test_an_adapter_cannot_take_its_base_models_name_even_with_redis_down(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16, '
                                                '"target_modules": ["q_proj"]}')
    env = launcher.child_env(REDIS_URL=f"redis://127.0.0.1:{launcher.free_port()}/0",
                             TESSERA_DB_PATH=str(tmp_path / "db.sqlite3"))
    for args in (["migrate", "-v0"],
                 ["lora_adapter", "add", "smollm2-135m-instruct", str(folder), "--base-model", "smollm2-135m-instruct"]):
        done = subprocess.run([sys.executable, launcher.MANAGE, *args], env=env, capture_output=True, text=True,
                              timeout=120, cwd=launcher.BASE_DIR)
    assert done.returncode != 0 and "'smollm2-135m-instruct' is a served model's name" in done.stderr, done.stderr


def test_chat_template_is_jinja_text_or_a_readable_file(tmp_path):
    from webapp.api.tokenization import read_chat_template
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(template)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}").startswith("{% for")
    with pytest.raises(ValueError, match="missing.jinja' is not a readable file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
