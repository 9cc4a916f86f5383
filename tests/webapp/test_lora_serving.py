"""LoRA adapters served as models through the real stack (Daphne, Redis, a Celery worker with
``--enable-lora``, the engine): listed in ``/v1/models`` with their base model as ``parent``, named in
``model``, owned by tenants (another tenant gets the unknown model's 404), loaded and unloaded at run time
(``/v1/load_lora_adapter``, ``manage.py lora_adapter``) by every worker of the base model, a worker started
later included; bad adapters refused with the limit named and nothing registered."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.tenants.helpers import bearer, make_tenant, wait_for, wait_usage
from tests.webapp.serving_stack import MODEL, Stack, http, metrics_text
from webapp import launcher

MAX_LORA_RANK = 8
NUM_TOKENS = 8
PROMPT = [1, 504, 3458, 282, 4649, 314]  # token ids: the completions take them as they are


def _make_adapters(folder, model, prompt: list[int]) -> dict:
    """PEFT adapters of SmolLM2 with random non-zero weights, and transformers + peft's greedy tokens for
    ``prompt`` under each (``None``: the base model)."""
    from tests.inference.conftest import hf_greedy
    from tests.inference.lora_adapters import ALL_TARGETS, make_peft_adapter

    reference = {None: hf_greedy(model, prompt, NUM_TOKENS)}
    specs = {"startup": dict(r=8, alpha=16, targets=ALL_TARGETS, seed=1),
             "owned": dict(r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=2),
             "rank16": dict(r=16, alpha=16, targets=["q_proj"], seed=3)}
    for name, spec in specs.items():
        peft_model = make_peft_adapter(model, folder / name, **spec)
        reference[name] = hf_greedy(peft_model, prompt, NUM_TOKENS)
        model = peft_model.unload()
    assert reference["startup"] != reference[None] and reference["owned"] != reference[None]
    return reference


def _other_base_adapter(folder) -> None:
    """A valid PEFT adapter of another model (hidden size 64, not SmolLM2's 576)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.inference.lora_adapters import make_peft_adapter

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    make_peft_adapter(LlamaForCausalLM(config), folder, r=4, alpha=8, targets=["q_proj"], seed=4)


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory, model_converted):
    """A stack of its own: one worker with ``--enable-lora --max-lora-rank 8 --lora-modules startup=...``, runtime
    loading on, and its database opened here through the ORM (tenants, keys, adapters, usage)."""
    from transformers import AutoModelForCausalLM

    from tests.inference.conftest import _packaged_gguf

    folder = tmp_path_factory.mktemp("adapters")
    gguf = _packaged_gguf()
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    reference = _make_adapters(folder, hf_model, PROMPT)
    del hf_model
    _other_base_adapter(folder / "other-base")

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command

    from tenants import shares

    call_command("migrate", interactive=False, verbosity=0)
    argv = [MODEL, "--max-model-len", "1024", "--kv-cache-space", "0.25", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", str(MAX_LORA_RANK), "--lora-modules", f"startup={folder / 'startup'}"]
    s = Stack(tmp_path_factory.mktemp("lora-stack"), 1, engine_argv=argv,
              TESSERA_DB_PATH=str(settings.DATABASES["default"]["NAME"]), TESSERA_ALLOW_RUNTIME_LORA_UPDATING="1")
    previous = shares.redis_url()
    shares.use_redis(s.redis_url)  # the adapters saved here are published to this stack's Redis
    yield s, folder, reference
    shares.use_redis(previous)
    s.stop()


def _complete(s: Stack, model: str, headers: dict | None = None) -> tuple[int, dict]:
    status, _, raw = http("POST", s.base_url + "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True},
        headers=headers)
    return status, json.loads(raw)


def _text(s: Stack, token_ids: list[int]) -> str:
    """The text of ``token_ids`` as the server detokenizes them."""
    status, _, raw = http("POST", s.base_url + "/detokenize", {"model": MODEL, "tokens": token_ids})
    assert status == 200
    return json.loads(raw)["prompt"]


def _models(s: Stack, headers: dict | None = None) -> dict[str, dict]:
    status, _, raw = http("GET", s.base_url + "/v1/models", headers=headers)
    assert status == 200
    return {m["id"]: m for m in json.loads(raw)["data"]}


def _manage(s: Stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, launcher.MANAGE, *args], env=s.env, capture_output=True, text=True,
                          cwd=launcher.BASE_DIR, timeout=120)


def test_a_startup_adapter_is_listed_with_its_base_model_and_served(lora_stack):
    s, folder, reference = lora_stack
    card = _models(s)["startup"]
    assert card["parent"] == MODEL and card["root"] == str(folder / "startup") and card["max_model_len"] == 1024
    status, body = _complete(s, "startup")
    assert status == 200, body
    assert body["model"] == "startup"
    assert body["choices"][0]["text"] == _text(s, reference["startup"])
    status, base = _complete(s, MODEL)
    assert status == 200 and base["choices"][0]["text"] == _text(s, reference[None])
    text = metrics_text(s.base_url)
    assert f'vllm:lora_requests_info{{max_lora="2",model_name="{MODEL}",' in text


def test_a_tenants_adapter_is_refused_to_another_tenant_with_404_and_served_to_it(lora_stack):
    from tenants.models import ApiKey

    s, folder, reference = lora_stack
    team_a, team_b = make_tenant(), make_tenant()
    _, key_a = ApiKey.issue(team_a)
    _, key_b = ApiKey.issue(team_b)
    added = _manage(s, "lora_adapter", "add", "a-only", str(folder / "owned"), "--base-model", MODEL,
                    "--tenant", team_a.slug)
    assert added.returncode == 0, added.stderr
    assert "a-only" in _models(s, bearer(key_a)) and "a-only" not in _models(s, bearer(key_b))
    for taken, words in ((MODEL, "served model's name"), ("startup", "start-up (--lora-modules)")):
        # a tenant's adapter named like the base model or a start-up adapter would take that name from the others
        refused = _manage(s, "lora_adapter", "add", taken, str(folder / "owned"), "--base-model", MODEL,
                          "--tenant", team_a.slug)
        assert refused.returncode != 0 and words in refused.stderr, refused.stderr
        from django.test import override_settings

        from webapp.catalog.admin import LoRAAdapterForm  # the admin's form refuses it the same way
        form = LoRAAdapterForm(data={"name": taken, "base_model": MODEL, "path": str(folder / "owned"), "tenant": ""})
        with override_settings(CELERY_BROKER_URL=s.redis_url):  # this process reads the stack's Redis
            assert not form.is_valid() and words in " ".join(form.errors.get("name", [])), form.errors

    status, refused = _complete(s, "a-only", bearer(key_b))
    unknown_status, unknown = _complete(s, "no-such-model", bearer(key_b))
    assert status == unknown_status == 404
    assert refused["error"] == {**unknown["error"], "message": unknown["error"]["message"].replace("no-such-model",
                                                                                                   "a-only")}
    status, _, raw = http("GET", s.base_url + "/v1/models/a-only", headers=bearer(key_b))
    assert status == 404, raw

    status, body = _complete(s, "a-only", bearer(key_a))
    assert status == 200, body
    assert body["model"] == "a-only" and body["choices"][0]["text"] == _text(s, reference["owned"])
    from tenants.models import Usage

    wait_usage(team_a, 1)
    row = Usage.objects.get(tenant=team_a)
    assert (row.model, row.requests, row.completion_tokens) == ("a-only", 1, NUM_TOKENS)
    assert not Usage.objects.filter(tenant=team_b, model="a-only", requests__gt=0, completion_tokens__gt=0).exists()
    from dashboard.access import Viewer
    from dashboard.adapter_usage import adapter_usage_today

    rows = {r.name: r for r in adapter_usage_today(Viewer("operator", True, frozenset(), None))}
    assert (rows["a-only"].tenant, rows["a-only"].requests) == (team_a.slug, 1)
    assert "a-only" not in {r.name for r in adapter_usage_today(Viewer("b", False, frozenset({team_b.slug}), None))}
    assert _manage(s, "lora_adapter", "remove", "a-only").returncode == 0


def _load(s: Stack, body: dict, headers: dict | None = None) -> tuple[int, str]:
    status, _, raw = http("POST", s.base_url + "/v1/load_lora_adapter", body, headers=headers)
    return status, raw.decode()


def _revoke_tenant_keys() -> None:
    """Revoke earlier tests' tenant keys: on this server (no --api-key) a request without a key is then the
    operator's, as on a development server."""
    from django.utils import timezone

    from tenants.models import ApiKey
    ApiKey.objects.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())


def test_bad_adapters_are_refused_naming_the_limit_and_nothing_is_registered(lora_stack, tmp_path):
    from tenants.models import ApiKey
    from webapp.catalog.models import LoRAAdapter

    s, folder, _ = lora_stack
    _revoke_tenant_keys()
    malformed = tmp_path / "malformed"
    malformed.mkdir()
    (malformed / "adapter_config.json").write_text("{not json")
    cases = [  # body -> (status, param, words of the message)
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, 400, "lora_path", ["no such folder"]),
        ({"lora_name": "x", "lora_path": str(malformed)}, 400, "lora_path", ["not valid JSON"]),
        ({"lora_name": "x", "lora_path": str(folder / "rank16")}, 400, "max_lora_rank", ["16", str(MAX_LORA_RANK)]),
        ({"lora_name": "x", "lora_path": str(folder / "other-base")}, 400, "lora_path", ["shape"]),
        ({"lora_name": "x"}, 400, "lora_path", ["required"]),
        ({"lora_name": "x", "lora_path": "adapters/owned"}, 400, "lora_path", ["absolute path"]),
        ({"lora_path": str(folder / "owned")}, 400, "lora_name", ["required"]),
        ({"lora_name": "startup", "lora_path": str(folder / "owned")}, 400, "lora_name", ["start-up"]),
        ({"lora_name": MODEL, "lora_path": str(folder / "owned")}, 400, "lora_name", ["served model"]),
        ({"lora_name": "x\n", "lora_path": str(folder / "owned")}, 400, "lora_name", ["letters"]),
        ({"lora_name": "x", "lora_path": str(folder / "owned"), "tenant": "t"}, 400, "tenant", ["Unknown field"]),
    ]
    for body, status, param, words in cases:
        got, raw = _load(s, body)
        error = json.loads(raw)["error"]
        assert (got, error["param"]) == (status, param), (body, raw)
        assert all(w in error["message"] for w in words), (body, error["message"])
    status, _, raw = http("POST", s.base_url + "/v1/unload_lora_adapter", {"lora_name": "startup"})
    assert status == 400 and "--lora-modules" in json.loads(raw)["error"]["message"], raw
    key, secret = ApiKey.issue(make_tenant())
    got, raw = _load(s, {"lora_name": "x", "lora_path": str(folder / "owned")}, bearer(secret))
    assert got == 403 and json.loads(raw)["error"]["code"] == "permission_denied"
    # once tenants have keys, a request without one is no longer the operator's (this server has no --api-key)
    got, raw = _load(s, {"lora_name": "x", "lora_path": str(folder / "owned")})
    assert got == 403 and "--api-key" in json.loads(raw)["error"]["message"], raw
    key.revoke()
    assert not LoRAAdapter.objects.filter(name="x").exists() and not s.redis.hexists("tessera:lora:adapters", "x")
    assert "x" not in _models(s)


def test_runtime_load_reaches_every_worker_a_later_one_too_and_unload_removes_it(lora_stack):
    """On a server without --api-key and no tenant keys (earlier tests' keys revoked) a request without a key
    is the operator's."""
    s, folder, reference = lora_stack
    _revoke_tenant_keys()
    status, text = _load(s, {"lora_name": "runtime", "lora_path": str(folder / "owned")})
    assert status == 200 and "runtime" in text, text
    assert _models(s)["runtime"]["parent"] == MODEL
    status, body = _complete(s, "runtime")
    assert status == 200 and body["choices"][0]["text"] == _text(s, reference["owned"])
    s.add_worker()  # a worker started after the load learns of it from the registry in Redis
    wait_for(lambda: len([w for w in s.worker_infos() if "runtime" in (w.get("lora") or {}).get("loaded", ())]) == 2,
             timeout=240, interval=0.5)
    status, _, raw = http("POST", s.base_url + "/v1/unload_lora_adapter", {"lora_name": "runtime"})
    assert status == 200, raw
    wait_for(lambda: all("runtime" not in (w.get("lora") or {}).get("loaded", ()) for w in s.worker_infos()))
    assert "runtime" not in _models(s)
    assert _complete(s, "runtime")[0] == 404
    status, _, raw = http("POST", s.base_url + "/v1/unload_lora_adapter", {"lora_name": "runtime"})
    assert status == 404 and json.loads(raw)["error"]["param"] == "lora_name"


def test_runtime_loading_is_off_unless_the_operator_turns_it_on(lora_stack, tmp_path_factory):
    s, folder, _ = lora_stack
    from django.conf import settings

    off = Stack(tmp_path_factory.mktemp("lora-off"), 0, redis_url=s.redis_url,
                TESSERA_DB_PATH=str(settings.DATABASES["default"]["NAME"]))
    try:
        status, raw = _load(off, {"lora_name": "x", "lora_path": str(folder / "owned")})
        assert status == 404 and "TESSERA_ALLOW_RUNTIME_LORA_UPDATING" in json.loads(raw)["error"]["message"]
        assert "startup" in _models(off)  # serving adapters needs no runtime loading
    finally:
        off.stop()


def test_serve_passes_the_lora_flags_to_its_workers():
    import argparse

    from webapp.cli import add_engine_arguments, engine_args_from_options, engine_argv

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flags = ["--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--lora-modules", "c=/z",
             "--max-loras", "2", "--max-lora-rank", "32", "--max-cpu-loras", "4"]
    args = engine_args_from_options(vars(parser.parse_args(flags)))
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (True, 2, 32, 4)
    assert args.lora_modules == ["a=/x", '{"name": "b", "path": "/y"}', "c=/z"]
    assert engine_args_from_options(vars(parser.parse_args(engine_argv(args)))) == args
    assert [m.lora_name for m in args.create_engine_config().lora.modules] == ["a", "b", "c"]


def test_startup_adapters_stay_with_the_startup_model():
    """An admin-loaded model on the same weights under another name does not get ``--lora-modules`` (their names
    would then name adapters of two models); the start-up model resumed on a new worker keeps them."""
    from inference import EngineArgs
    from webapp.serving.model_spec import ModelSpec

    base = EngineArgs(model=MODEL, served_model_name="smol", enable_lora=True, lora_modules=["sql=/adapters/sql"])
    assert ModelSpec.from_engine_args(base).engine_args(base).lora_modules == ["sql=/adapters/sql"]
    assert ModelSpec(name="smol-long", source=MODEL, max_model_len=4096).engine_args(base).lora_modules is None
    assert ModelSpec(name="smol", source="/models/other.gguf").engine_args(base).lora_modules is None
