"""Model management through the admin, on the real stack: a worker started without a model,
a model registered in the admin's catalog, loaded on that worker by an admin action,
answering requests, and unloaded again; ``/v1/models`` and ``/metrics`` follow, a broken
model's load fails visibly and leaves the worker usable, and the worker logs its engine
stats every 5 s."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.webapp.browser import Browser
from tests.webapp.serving_stack import MODEL, Stack, http, metric_value, metrics_text, sse_events
from webapp import launcher

NAME = "smol-admin"
PASSWORD = "admin-pw"


@pytest.fixture(scope="module")
def idle(tmp_path_factory):
    """A stack of its own whose only worker starts with no model; and a logged-in admin."""
    logs = tmp_path_factory.mktemp("catalog")
    s = Stack(logs, num_workers=0)
    worker_log = logs / "idle-worker.log"
    s.workers.append(launcher.start_worker(["--no-model", "--max-model-len", "2048", "--kv-cache-space", "0.25"],
                                           s.env, log_path=str(worker_log)))
    subprocess.run([sys.executable, launcher.MANAGE, "createsuperuser", "--noinput", "--username", "admin",
                    "--email", "admin@example.com"], env={**s.env, "DJANGO_SUPERUSER_PASSWORD": PASSWORD},
                   check=True, cwd=launcher.BASE_DIR)
    browser = Browser(s.base_url)
    browser.login("/admin/login/", "admin", PASSWORD)
    worker_id = _wait(lambda: [w["id"] for w in s.worker_infos()], 120)[0]
    yield s, browser, worker_id, worker_log
    s.stop()


def _wait(condition, timeout: float, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(interval)
    return value


def _models(s: Stack) -> list[str]:
    status, _, body = http("GET", s.base_url + "/v1/models")
    assert status == 200
    return [m["id"] for m in json.loads(body)["data"]]


def _register(browser: Browser, name: str, source: str, max_model_len: int = 1024,
              path: str = "/admin/catalog/servedmodel/add/", quantization: str = "",
              tensor_parallel_size: int = 1) -> tuple[int, str]:
    browser.get(path)
    status, _, page = browser.post(path, {
        "name": name, "source": source, "dtype": "auto", "quantization": quantization,
        "max_model_len": str(max_model_len), "gpu_memory_utilization": "0.9", "max_num_seqs": "8",
        "tensor_parallel_size": str(tensor_parallel_size), "enabled": "on"})
    return status, page


def _worker_row(browser: Browser, worker_id: str) -> dict[str, str]:
    """The worker's state and error as the admin's worker list shows them."""
    status, _, page = browser.get("/admin/catalog/worker/")
    assert status == 200 and worker_id in page
    row = page[page.index(worker_id):]
    row = row[:row.index("</tr>")]
    return {field: re.sub(r"<[^>]+>", "", re.search(rf'class="field-{field}"[^>]*>(.*?)</td>', row, re.S)[1]).strip()
            for field in ("model", "state", "error", "device")}


def _act(browser: Browser, worker_id: str, action: str, model: str | None = None) -> None:
    browser.get("/admin/catalog/worker/")
    data = {"action": action, "_selected_action": worker_id}
    if model is not None:
        data["served_model"] = re.search(rf'<option value="(\d+)">{re.escape(model)}</option>', browser.page)[1]
    status, headers, _ = browser.post("/admin/catalog/worker/", data)
    assert status == 302, status


def test_a_bad_source_is_refused_with_its_reason_and_nothing_saved(idle):
    s, browser, _, _ = idle
    status, page = _register(browser, "nowhere", "/no/such/model.gguf")
    assert status == 200 and "The GGUF file /no/such/model.gguf does not exist." in page
    status, page = _register(browser, "not-a-model", "llama-99")
    assert status == 200 and "is not a model source" in page
    status, page = _register(browser, "int3", MODEL, quantization="int3")
    assert status == 200 and "Unknown method &#x27;int3&#x27;" in page
    # what the model's config rules out is refused at the save, on its field, not at a worker's load
    status, page = _register(browser, "too-long", MODEL, max_model_len=999999)
    assert status == 200 and _field_error(page, "max_model_len").startswith("max_model_len=999999 exceeds the model")
    status, page = _register(browser, "not-awq", MODEL, quantization="awq")
    assert status == 200 and "awq" in _field_error(page, "quantization")
    status, page = _register(browser, "tp4", MODEL, tensor_parallel_size=4)
    assert status == 200 and "valid sizes: 1, 3, 9" in _field_error(page, "tensor_parallel_size")
    _, _, listing = browser.get("/admin/catalog/servedmodel/")
    for name in ("nowhere", "not-a-model", "int3", "too-long", "not-awq", "tp4"):
        assert name not in listing


def _field_error(page: str, field: str) -> str:
    """The error the admin's form shows on ``field`` ('' if none)."""
    found = re.search(rf'<ul class="errorlist[^"]*" id="id_{field}_error"><li>(.*?)</li>', page, re.S)
    if found is None:
        found = re.search(rf'field-{field}.*?<ul class="errorlist[^"]*"[^>]*><li>(.*?)</li>', page, re.S)
    return found[1].replace("&#x27;", "'") if found else ""


def test_a_failed_load_shows_its_error_and_leaves_the_worker_idle(idle, tmp_path):
    s, browser, worker_id, _ = idle
    assert _worker_row(browser, worker_id)["state"] == "idle"
    from inference.model_loader import resolve_model

    broken = tmp_path / "broken-checkpoint"  # a real config, weights that are not a safetensors file
    broken.mkdir()
    shutil.copy(resolve_model(MODEL).model_dir / "config.json", broken / "config.json")
    (broken / "model.safetensors").write_bytes(b"not a checkpoint" * 64)
    status, _ = _register(browser, "broken", str(broken))
    assert status == 302
    _act(browser, worker_id, "load_model", "broken")
    row = _wait(lambda: (r := _worker_row(browser, worker_id))["state"] == "failed" and r, 120)
    assert row["error"] and row["model"] in ("", "-") and row["device"] == "cpu"
    assert _models(s) == []
    assert http("GET", s.base_url + "/health")[0] == 503


def test_load_serve_and_unload_through_the_admin(idle):
    s, browser, worker_id, worker_log = idle
    assert _register(browser, NAME, MODEL)[0] == 302
    assert _models(s) == []
    status, _, body = http("POST", s.base_url + "/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 2})
    assert status == 503 and json.loads(body)["error"]["code"] == "service_unavailable"  # known, not served

    _act(browser, worker_id, "load_model", NAME)
    _wait(lambda: _models(s) == [NAME], 180)
    assert _worker_row(browser, worker_id) | {"error": ""} == {"model": NAME, "state": "ready", "error": "",
                                                               "device": "cpu"}
    _, _, body = http("GET", s.base_url + "/v1/models")
    assert json.loads(body)["data"][0]["max_model_len"] == 1024  # the catalog's setting, not the worker's flag

    before = metrics_text(s.base_url)
    status, _, body = http("POST", s.base_url + "/v1/completions",
                           {"model": NAME, "prompt": "Count:", "max_tokens": 5, "ignore_eos": True},
                           headers={"X-Tenant-ID": "default"})
    reply = json.loads(body)
    assert status == 200 and reply["model"] == NAME and reply["usage"]["completion_tokens"] == 5, reply
    prompt_tokens = reply["usage"]["prompt_tokens"]
    label = f'model_name="{NAME}"'
    success = f'vllm:request_success_total{{finished_reason="length",{label}}}'
    generated = f"vllm:generation_tokens_total{{{label}}}"
    # The worker pushes its request metrics as outputs arrive and the engine's token counters from its last
    # stats snapshot: one push can hold the success and not yet every token (both are eventually exact).
    after = _wait(lambda: (lambda t: t if metric_value(t, success) == 1 and metric_value(t, generated) == 5
                           else None)(metrics_text(s.base_url)), 10)
    families = {f.name: f for f in text_string_to_metric_families(after)}  # the Prometheus parser reads it all
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_preemptions", "vllm:request_success",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "tessera:tenant_prompt_tokens",
                 "tessera:tenant_generation_tokens", "tessera:tenant_requests", "tessera:gpu_utilization_perc",
                 "tessera:gpu_memory_used_bytes"):
        assert name in families, name
    assert metric_value(after, f"vllm:e2e_request_latency_seconds_count{{{label}}}") == 1
    tenant = f'{label},tenant="default"'
    tenant_counts = {
        "generation": metric_value(after, f"tessera:tenant_generation_tokens_total{{{tenant}}}")
        - metric_value(before, f"tessera:tenant_generation_tokens_total{{{tenant}}}"),
        "prompt": metric_value(after, f"tessera:tenant_prompt_tokens_total{{{tenant}}}")
        - metric_value(before, f"tessera:tenant_prompt_tokens_total{{{tenant}}}"),
        "requests": metric_value(after, f'tessera:tenant_requests_total{{finished_reason="length",{tenant}}}')
        - metric_value(before, f'tessera:tenant_requests_total{{finished_reason="length",{tenant}}}')}
    assert tenant_counts == {"generation": 5, "prompt": prompt_tokens, "requests": 1}
    assert not [s for f in families.values() if f.name.startswith("tessera:gpu") for s in f.samples]  # no GPU here

    # A request without "model" goes to the one model served (not to the packaged model of `serve`).
    status, _, body = http("POST", s.base_url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and json.loads(body)["model"] == NAME

    # The worker logs its engine stats every 5 s, in vLLM's words, with the tokens just served.
    stats_line = re.compile(rf"{NAME}: Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: "
                            r"([\d.]+) tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: "
                            r"[\d.]+%, Prefix cache hit rate: [\d.]+%")
    _wait(lambda: any(float(m[2]) > 0 for m in stats_line.finditer(worker_log.read_text())), 15)

    # Reload applies the model's edited settings, in the same worker process.
    _, _, listing = browser.get("/admin/catalog/servedmodel/")
    change = re.search(r'href="(/admin/catalog/servedmodel/\d+/change/)[^"]*">' + NAME + "<", listing)[1]
    assert _register(browser, NAME, MODEL, max_model_len=512, path=change)[0] == 302
    _act(browser, worker_id, "reload_model")
    _wait(lambda: [(m["id"], m["max_model_len"]) for m in json.loads(http("GET", s.base_url + "/v1/models")[2])["data"]]
          == [(NAME, 512)], 180)
    assert s.worker_infos()[0]["pid"] == s.workers[0].pid

    # A model this machine cannot run (FP8 on a CPU) is refused before the served one is unloaded.
    assert _register(browser, "smol-fp8", MODEL, quantization="fp8")[0] == 302
    _act(browser, worker_id, "load_model", "smol-fp8")
    row = _wait(lambda: (r := _worker_row(browser, worker_id))["error"].count("FP8 tensor cores") and r, 60)
    assert (row["model"], row["state"]) == (NAME, "ready")
    status, _, body = http("POST", s.base_url + "/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 2})
    assert status == 200 and _models(s) == [NAME]

    # Unloading ends a running request with an error that says why; the model leaves /v1/models.
    events: list[str] = []
    reader = threading.Thread(target=lambda: events.extend(sse_events(http(
        "POST", s.base_url + "/v1/completions", {"model": NAME, "prompt": "Tell a long story.", "max_tokens": 400,
                                                 "ignore_eos": True, "stream": True}, timeout=120)[2])))
    reader.start()
    _wait(lambda: metric_value(metrics_text(s.base_url), f"vllm:num_requests_running{{{label}}}") == 1, 30, 0.05)
    _act(browser, worker_id, "unload_model")
    reader.join(60)
    assert events[-1] == "[DONE]" and "unloaded" in json.loads(events[-2])["error"]["message"]
    assert json.loads(events[-2])["error"]["type"] == json.loads(events[-2])["error"]["code"] == "service_unavailable"
    assert _models(s) == []  # at once: the worker stopped admitting before it stopped the engine
    _wait(lambda: _worker_row(browser, worker_id)["state"] == "idle", 60)
    status, _, body = http("POST", s.base_url + "/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 2})
    assert status == 503
    # The unloaded model's counters stay (they never go backwards); no worker serves it.
    text = metrics_text(s.base_url)
    assert metric_value(text, f"vllm:generation_tokens_total{{{label}}}") >= 5
    assert f"tessera:num_workers{{{label}}} 0.0" in text
