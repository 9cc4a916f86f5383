"""The dashboard as operators and tenant members use it, on the real stack (Redis, the shared
SmolLM2 worker, Daphne): the ``/ws/stats`` consumer against the real ASGI application with
``WebsocketCommunicator`` (anonymous refused, a snapshot on connect, updates as the worker
publishes, each user cut to what they may see), the pages behind their login, and the live
page in headless Chromium: log in, watch tokens/s change under load, survive a restart
(screenshots in test-artifacts/)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.tenants.helpers import make_tenant, orm, wait_usage, web  # noqa: F401 (fixtures)
from tests.webapp.browser import Browser
from tests.webapp.serving_stack import MODEL, http
from webapp import launcher


@pytest.fixture(scope="module")
def people(orm):
    """A staff user; alice, member of tenant red (may use the served model); bob, member of
    blue (may use another model only)."""
    from django.contrib.auth.models import User

    suffix = uuid.uuid4().hex[:6]
    users = {"staff": User.objects.create_user(f"ops-{suffix}", password="ops-pw", is_staff=True),
             "alice": User.objects.create_user(f"alice-{suffix}", password="alice-pw"),
             "bob": User.objects.create_user(f"bob-{suffix}", password="bob-pw")}
    red = make_tenant(slug=f"red-{suffix}", gpu_share=30, daily_token_budget=100_000, allowed_models=[MODEL])
    blue = make_tenant(slug=f"blue-{suffix}", gpu_share=20, allowed_models=["some-other-model"])
    red.members.add(users["alice"])
    blue.members.add(users["bob"])
    from django.contrib.auth.models import Permission

    users["staff"].user_permissions.add(*Permission.objects.filter(codename__in=["view_tenant", "change_tenant"]))
    return {**users, "red": red, "blue": blue}


@pytest.fixture(scope="module")
def dashboard_web(stack, orm, tmp_path_factory):
    """A Daphne on the shared Redis and the ORM's database (no worker of its own)."""
    s = web(stack, orm, tmp_path_factory, "dashboard-web")
    yield s
    s.stop()


def session_cookie(user) -> list[tuple[bytes, bytes]]:
    """WebSocket headers carrying a logged-in session of ``user``."""
    from django.test import Client

    client = Client()
    client.force_login(user)
    return [(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())]


async def _messages(app, headers, count: int, until=None, timeout: float = 60.0) -> list[dict]:
    """Connect to /ws/stats and collect ``count`` messages (or until ``until(message)``)."""
    from channels.testing import WebsocketCommunicator

    communicator = WebsocketCommunicator(app, "/ws/stats", headers=headers)
    connected, _ = await communicator.connect()
    assert connected
    messages, deadline = [], time.monotonic() + timeout
    try:
        while len(messages) < count or (until is not None and not until(messages[-1])):
            assert time.monotonic() < deadline, f"no matching message in {timeout} s: {messages[-1:]}"
            messages.append(await communicator.receive_json_from(timeout=5))
    finally:
        await communicator.disconnect()
    return messages


class BackgroundLoad:
    """Threads sending completions through ``base_url`` until :meth:`stop`; ``errors`` holds
    what went wrong (a status other than 200, an exception)."""

    def __init__(self, base_url: str, headers: dict, concurrency: int = 2, max_tokens: int = 8) -> None:
        self.base_url, self.headers, self.max_tokens = base_url, headers, max_tokens
        self.errors: list[str] = []
        self.done = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(concurrency)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status, _, body = http("POST", self.base_url + "/v1/completions",
                                       {"model": MODEL, "prompt": "Count to fifty:", "max_tokens": self.max_tokens,
                                        "ignore_eos": True}, headers=self.headers, timeout=600)
            except Exception as error:  # noqa: BLE001 (reported by the test)
                self.errors.append(repr(error))
                return
            if status != 200:
                self.errors.append(f"{status} {body[:200]!r}")
            self.done += 1

    def stop(self) -> None:
        """Stop sending; returns once the requests in flight have ended."""
        self._stop.set()
        for thread in self._threads:
            thread.join(600)


def test_anonymous_websocket_is_refused(orm, django_app):
    from channels.testing import WebsocketCommunicator

    async def run() -> tuple[dict, bool]:
        communicator = WebsocketCommunicator(django_app, "/ws/stats")
        await communicator.connect()
        closed = await communicator.receive_output(timeout=5)
        await communicator.send_input({"type": "websocket.disconnect", "code": closed["code"]})
        await asyncio.wait_for(asyncio.shield(communicator.future), timeout=5)
        return closed, communicator.future.done()

    closed, consumer_ended = asyncio.run(run())
    assert closed == {"type": "websocket.close", "code": 4401}
    assert consumer_ended, "the refused socket's consumer should end once the client goes"


def test_frames_a_client_sends_are_ignored_and_the_stream_goes_on(django_app, people, stack):
    from channels.testing import WebsocketCommunicator
    headers = session_cookie(people["staff"])

    async def run() -> list[dict]:
        communicator = WebsocketCommunicator(django_app, "/ws/stats", headers=headers)
        connected, _ = await communicator.connect()
        assert connected
        try:
            first = await communicator.receive_json_from(timeout=5)
            await communicator.send_to(text_data="garbage")  # not JSON
            await communicator.send_to(bytes_data=b"\xff\x00")
            return [first, await communicator.receive_json_from(timeout=5)]  # the next sample still comes
        finally:
            await communicator.disconnect()

    first, second = asyncio.run(run())
    assert "models" in first and "models" in second


def test_snapshot_on_connect_then_updates_as_the_worker_publishes(django_app, people, stack, dashboard_web):
    headers = session_cookie(people["staff"])
    (first,) = asyncio.run(_messages(django_app, headers, 1))
    (model,) = [m for m in first["models"] if m["name"] == MODEL]
    (worker,) = model["workers"]
    assert worker["state"] == "ready" and worker["host"] and worker["uptime_s"] > 0
    assert 0 <= first["totals"]["kv_cache_usage"] <= 1

    load = BackgroundLoad(dashboard_web.base_url, {})
    try:  # tokens flow, and the requests' first tokens are in the latency window
        busy = asyncio.run(_messages(django_app, headers, 2, timeout=300, until=lambda m: (
            (m["totals"]["output_tokens_per_s"] or 0) > 0 and m["totals"]["num_requests_running"] > 0
            and m["totals"]["ttft_p50_s"] is not None)))
    finally:
        load.stop()
    assert not load.errors and load.done >= 2
    times = [m["time"] for m in busy]
    assert times == sorted(times) and len(set(times)) == len(times)  # a new sample each message
    assert busy[0]["time"] > first["time"]
    # the finished requests' time per output token is in the window too
    after = asyncio.run(_messages(django_app, headers, 1, until=lambda m: m["totals"]["tpot_p50_s"] is not None))[-1]
    totals = after["totals"]
    assert 0 < totals["ttft_p50_s"] <= totals["ttft_p99_s"] and 0 < totals["tpot_p50_s"] <= totals["tpot_p99_s"]


def test_each_user_sees_what_they_may(django_app, people, dashboard_web):
    red, blue = people["red"], people["blue"]
    status, _, body = http("POST", dashboard_web.base_url + "/v1/completions",
                           {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True},
                           headers={"X-Tenant-ID": red.slug})
    assert status == 200, body
    used = wait_usage(red, 1)

    def red_used(message: dict) -> bool:  # the tenants' usage is read every few seconds
        return any(t["tokens"] for t in message["tenants"] if t["slug"] == red.slug)

    def tenant_rows(user, until=red_used) -> tuple[dict, dict]:
        message = asyncio.run(_messages(django_app, session_cookie(user), 1, until=until))[-1]
        return message, {t["slug"]: t for t in message["tenants"]}

    staff, rows = tenant_rows(people["staff"])
    assert {red.slug, blue.slug} <= set(rows) and "default" in rows
    assert rows[red.slug]["tokens"] == used["prompt_tokens"] + used["completion_tokens"]
    assert 0 < rows[red.slug]["share"] <= 1 and rows[red.slug]["gpu_share"] == 30
    assert rows[red.slug]["budget_used"] == pytest.approx(rows[red.slug]["tokens"] / 100_000)
    assert [w["model"] for m in staff["models"] for w in m["workers"]]

    alice, rows = tenant_rows(people["alice"])
    assert set(rows) == {red.slug}
    assert [m["name"] for m in alice["models"]] == [MODEL] and "workers" not in alice["models"][0]

    bob, rows = tenant_rows(people["bob"], until=None)
    assert set(rows) == {blue.slug} and rows[blue.slug]["tokens"] == 0
    assert bob["models"] == [] and bob["totals"]["num_workers"] == 0


def test_pages_need_a_login_and_show_the_users_tenants_only(people, dashboard_web):
    browser = Browser(dashboard_web.base_url)
    for path in ("/dashboard/", "/dashboard/live/"):
        status, headers, _ = browser.get(path)
        assert status == 302 and headers["Location"].startswith("/tenants/login/?next=/dashboard/"), (path, headers)

    browser.login("/tenants/login/", people["alice"].username, "alice-pw")
    status, _, page = browser.get("/dashboard/")
    assert status == 200
    snapshot = json.loads(re.search(r'<script id="initial-snapshot" type="application/json">(.*?)</script>',
                                    page, re.S)[1])
    assert [t["slug"] for t in snapshot["tenants"]] == [people["red"].slug]
    assert people["blue"].slug not in page and 'id="workers"' not in page

    browser = Browser(dashboard_web.base_url)
    browser.login("/tenants/login/", people["staff"].username, "ops-pw")
    status, _, page = browser.get("/dashboard/live/")
    assert status == 200 and 'id="tokens-per-s"' in page
    for script in re.findall(r'<script src="([^"]+)"', page):  # uPlot and the page's script, served locally
        assert script.startswith("/static/") and http("GET", dashboard_web.base_url + script)[0] == 200, script


# ---- in a real browser: Debian's headless Chromium, driven through its chromedriver ------------
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
NUMBER = re.compile(r"\d+(\.\d+)?")


@pytest.fixture
def chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):
        assert os.access(path, os.X_OK), f"{path} is missing (make system-packages installs chromium, chromium-driver)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1200"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)  # the system driver, no download
    yield driver
    driver.quit()


def test_live_page_in_chromium_under_load_and_across_a_server_restart(chromium, people, dashboard_web):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver, base_url = chromium, dashboard_web.base_url
    wait = WebDriverWait(driver, 120, poll_frequency=0.2)
    connection = lambda d: d.find_element(By.ID, "connection").get_attribute("data-state")  # noqa: E731
    driver.get(base_url + "/dashboard/live/")
    assert "/tenants/login/" in driver.current_url  # pages need a login
    driver.find_element(By.NAME, "username").send_keys(people["staff"].username)
    driver.find_element(By.NAME, "password").send_keys("ops-pw")
    driver.find_element(By.XPATH, "//form[.//input[@name='username']]//button").click()
    wait.until(lambda d: d.current_url == base_url + "/dashboard/live/" and connection(d) == "open")
    assert len(driver.find_elements(By.CSS_SELECTOR, "[data-chart] canvas")) == 4  # uPlot drew the charts

    assert driver.find_elements(By.CSS_SELECTOR, "[data-share-chart] canvas")  # the tenants' share chart
    red = people["red"].slug
    load = BackgroundLoad(base_url, {"X-Tenant-ID": red})
    try:  # the tokens/s number changes as the worker publishes
        readings: list[str] = []

        def changed(d) -> bool:
            text = d.find_element(By.ID, "tokens-per-s").text
            if not readings or readings[-1] != text:
                readings.append(text)
            numbers = [float(t) for t in readings if NUMBER.fullmatch(t)]
            return len(set(numbers)) >= 2 and max(numbers) > 0

        WebDriverWait(driver, 300, poll_frequency=0.2).until(changed, message=f"tokens/s read {readings}")

        def red_served(d) -> float:  # red's line on the share chart: its share of the recently served tokens
            latest = json.loads(d.find_element(By.CSS_SELECTOR, "[data-share-chart]").get_attribute("data-latest")
                                or "{}")
            return (latest.get(red) or {}).get("served") or 0.0

        # Only red sends: its share of the served tokens climbs towards 100%, against its quota of 30%.
        WebDriverWait(driver, 120, poll_frequency=0.2).until(lambda d: red_served(d) > 50,
                                                             message="red's served share did not show")
        legend = driver.find_element(By.CSS_SELECTOR, "[data-share-chart]").text
        assert f"{red} served" in legend and f"{red} share" in legend, legend
        # The admin's page of the tenant charts the same, for that tenant only.
        driver.get(f"{base_url}/admin/tenants/tenant/{people['red'].pk}/change/")
        WebDriverWait(driver, 120, poll_frequency=0.2).until(lambda d: red_served(d) > 50,
                                                             message="the admin's tenant page showed no share")
        legend = driver.find_element(By.CSS_SELECTOR, "[data-share-chart]").text
        assert f"{red} served" in legend and people["blue"].slug not in legend, legend
        ARTIFACTS.mkdir(exist_ok=True)
        assert driver.save_screenshot(str(ARTIFACTS / "admin-tenant-share.png"))
        driver.get(base_url + "/dashboard/live/")
        wait.until(lambda d: connection(d) == "open")
        ARTIFACTS.mkdir(exist_ok=True)
        screenshot = ARTIFACTS / "dashboard-live.png"
        assert driver.save_screenshot(str(screenshot))
        print(f"screenshot of the live page: {screenshot} (tokens/s read {readings})")
    finally:
        load.stop()
    assert not load.errors

    # the page reconnects by itself after a server restart
    dashboard_web.daphne.stop()
    wait.until(lambda d: connection(d) == "closed")
    updated = driver.find_element(By.ID, "dashboard").get_attribute("data-updated")
    dashboard_web.daphne = launcher.start_daphne("127.0.0.1", dashboard_web.port, dashboard_web.env,
                                                 log_path=str(dashboard_web.logs_dir / "daphne-restarted.log"))
    wait.until(lambda d: connection(d) == "open"
               and d.find_element(By.ID, "dashboard").get_attribute("data-updated") != updated)
    driver.get(base_url + "/dashboard/")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'#models tr[data-key="{MODEL}"]'))
    assert driver.save_screenshot(str(ARTIFACTS / "dashboard-overview.png"))


def test_websocket_from_another_site_is_refused_even_with_a_session(orm, django_app, people):
    """Cross-site WebSocket hijacking: a page elsewhere opening /ws/stats with the staff user's cookie."""
    from channels.testing import WebsocketCommunicator

    cookie = session_cookie(people["staff"])

    async def connect(origin: bytes) -> bool:
        headers = cookie + [(b"host", b"tessera.example:8000"), (b"origin", origin)]
        communicator = WebsocketCommunicator(django_app, "/ws/stats", headers=headers)
        connected, _ = await communicator.connect(timeout=10)
        await communicator.disconnect()
        return connected

    assert asyncio.run(connect(b"http://evil.example")) is False
    assert asyncio.run(connect(b"http://tessera.example:8000")) is True
