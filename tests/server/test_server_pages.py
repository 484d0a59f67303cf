"""The pages the server serves: the chat page at / (driven in Debian's Chromium by Playwright:
a streamed reply, and Stop aborting the request in the engine), /docs from the vendored
Swagger UI (nothing from a CDN), and CORS with --allowed-origins."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MODEL_NAME, ServerThread, wait_until

from flashlet.server import ServerConfig, create_app

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("DOCS_CHROMIUM", "/usr/bin/chromium")
ORIGIN = "http://app.example.test"


def metrics(url: str) -> dict:
    """{(name, labels as a sorted tuple): value} of the server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def aborted_chats(url: str) -> float:
    return metrics(url).get(("flashlet_requests_finished_total",
                             (("endpoint", "chat"), ("finish_reason", "abort"))), 0.0)


def test_pages_and_docs_need_no_cdn(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "chat.js" in page.text
    for asset in ("chat.js", "chat.css", "swagger/swagger-ui-bundle.js", "swagger/swagger-ui.css"):
        assert httpx.get(f"{server.url}/static/{asset}").status_code == 200, asset
    docs = httpx.get(server.url + "/docs")
    assert docs.status_code == 200
    assert "/static/swagger/swagger-ui-bundle.js" in docs.text
    assert not re.search(r"(src|href)=\"https?://", docs.text), docs.text
    assert httpx.get(server.url + "/redoc").status_code == 404  # it would need a CDN
    assert "/" not in httpx.get(server.url + "/openapi.json").json()["paths"]


@pytest.fixture(scope="module")
def cors_server(engine_loop):
    srv = ServerThread(create_app(engine_loop, ServerConfig(
        model_name=MODEL_NAME, allowed_origins=(ORIGIN,), api_key="k"))).start()
    yield srv
    srv.stop()


def test_cors_preflight_and_responses(cors_server, server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(cors_server.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 200, r.text  # no API key needed for a preflight
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.get(cors_server.url + "/v1/models",
                  headers={"Origin": ORIGIN, "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    # Another origin, or a server without --allowed-origins: no CORS headers.
    r = httpx.options(cors_server.url + "/v1/chat/completions",
                      headers={**preflight, "Origin": "http://evil.test"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers


@pytest.fixture(scope="module")
def browser():  # module scope: Playwright's sync API holds an event loop in this thread
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (install Debian's: apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright (Python) is not installed")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    """A page whose requests to any host but 127.0.0.1 fail the test; so do JavaScript errors."""
    context = browser.new_context()
    foreign: list[str] = []

    def block(route):
        foreign.append(route.request.url)
        route.abort()

    # Only foreign URLs are intercepted: the server's SSE responses stream untouched.
    context.route(re.compile(r"^(https?|wss?)://(?!127\.0\.0\.1[:/])"), block)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not foreign, f"requests to other hosts: {foreign}"
    assert not errors, f"JavaScript errors: {errors}"


def test_chat_page_streams_a_reply_and_stop_aborts_it(page, server, engine_loop, idle):
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model-name').textContent === "
                           f"{MODEL_NAME!r}")
    # A short reply first: it streams in and finishes.
    page.fill("#max-tokens", "8")
    page.fill("#prompt", "Say hello.")
    page.click("#send")
    page.wait_for_selector("#status:text('finished')", timeout=120_000)
    replies = page.locator(".message.assistant")
    assert replies.count() == 1 and replies.first.inner_text().strip()
    # A long one, stopped as soon as its first words are on the page.
    before = aborted_chats(server.url)
    page.fill("#max-tokens", "1500")
    page.fill("#prompt", "Write a long story about a dragon.")
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('.message.assistant')[1]"
                           "?.textContent.length > 0", timeout=120_000)
    assert page.is_enabled("#stop")
    page.click("#stop")
    page.wait_for_selector(".message.assistant .note:text('(stopped)')", timeout=30_000)
    assert page.inner_text("#status") == "stopped"
    # The server aborted it, and its pages went back (only the prefix cache holds any).
    wait_until(lambda: aborted_chats(server.url) == before + 1, 30, "the abort on /metrics")
    wait_until(lambda: (m := metrics(server.url)) and
               m[("flashlet_requests_running", (("core", "0"),))] == 0 and
               m[("flashlet_kv_pages_used", (("core", "0"),))] ==
               m[("flashlet_kv_pages_cached", (("core", "0"),))], 30, "the pages freed")
    stats = engine_loop.call(lambda e: e.stats()).result(60)
    assert stats["requests"] == 0 and stats["kv_pages_used"] == stats["kv_pages_cached"]
