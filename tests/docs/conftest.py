"""Fixtures for the documentation site tests: the fake repository, its built site, and that site
served over HTTP on 127.0.0.1 to a headless Chromium."""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from pathlib import Path

import pytest

from docs_helpers import CHROMIUM, make_fixture_repo, run_builder


@pytest.fixture(scope="session")
def docs_fixture_repo(tmp_path_factory) -> Path:
    return make_fixture_repo(tmp_path_factory.mktemp("docs-repo") / "repo")


@pytest.fixture(scope="session")
def docs_site(docs_fixture_repo, tmp_path_factory) -> Path:
    """The fixture repository's site, built once for the session."""
    out = tmp_path_factory.mktemp("docs-site") / "_site"
    proc = run_builder("--repo-root", docs_fixture_repo, "--out", out)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture()
def docs_scratch_repo(docs_fixture_repo, tmp_path) -> Path:
    """A private copy of the fixture repository that a test may break."""
    root = tmp_path / "repo"
    shutil.copytree(docs_fixture_repo, root)
    return root


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def docs_server(docs_site):
    """docs_site served on 127.0.0.1 on a free port; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(docs_site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(scope="module")  # not session: Playwright's sync API keeps an event loop
def docs_browser():  # running in this thread while it lives, which breaks later asyncio.run()
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (install Debian's: apt-get install -y chromium)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright (Python) is not installed"
    )
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture()
def docs_page(docs_browser):
    """A fresh page whose every request to a host other than 127.0.0.1 is blocked and recorded.

    The test fails at teardown if any such request was made."""
    context = docs_browser.new_context(
        viewport={"width": 1400, "height": 900}, device_scale_factor=1
    )
    foreign: list[str] = []

    def route(route_):
        url = route_.request.url
        host = url.split("//", 1)[-1].split("/", 1)[0].split(":")[0] if "//" in url else ""
        if url.startswith(("http://", "https://", "ws://", "wss://")) and host != "127.0.0.1":
            foreign.append(url)
            route_.abort()
        else:
            route_.continue_()

    context.route("**/*", route)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not foreign, f"requests to other hosts: {foreign}"
    assert not errors, f"JavaScript errors: {errors}"
