"""The built site in a real browser: Debian's Chromium, headless, driven by Playwright.

The site is served from 127.0.0.1; every request to another host is blocked and fails the test
(see the docs_page fixture), and so does any JavaScript error.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qs

import pytest

from docs_helpers import ARTIFACTS

COMPARE = "compare.html#from=v01_0_ragged_batch&to=v02_kv_cache&file=model.py&view=unified"


def wait_ready(page):
    page.wait_for_selector("#compare-app[data-state=ready]")


def wait_rendered(page, condition: str):
    """Until the page shows a state whose URL hash meets `condition` (JS on `hash`, e.g.
    "hash.includes('view=split')"): a click sets the hash and the app renders on the hashchange
    event after it, so the hash alone can run ahead of what is on screen."""
    page.wait_for_function(f"(hash => {condition})(document.querySelector('#compare-app').dataset.hash || '')")


def state(page) -> dict[str, str]:
    """The comparison state in the page's URL hash."""
    fragment = page.evaluate("location.hash").lstrip("#")
    return {k: v[0] for k, v in parse_qs(fragment).items()}


def context_rows(page) -> int:
    return page.locator("#cmp-diff tr:has(td.d2h-cntx)").count()


def code_text(page) -> str:
    return page.locator("#cmp-diff").inner_text()


def test_a_comparison_url_opens_that_view(docs_page, docs_server):
    page = docs_page
    page.goto(docs_server + COMPARE)
    wait_ready(page)
    assert page.locator("#cmp-from").input_value() == "v01_0_ragged_batch"
    assert page.locator("#cmp-to").input_value() == "v02_kv_cache"
    assert page.locator(".file-item.selected").get_attribute("data-path") == "model.py"
    assert page.locator("#cmp-view-unified").get_attribute("aria-pressed") == "true"
    assert page.locator("#cmp-view-split").get_attribute("aria-pressed") == "false"
    assert page.locator("#cmp-diff .d2h-file-diff").count() == 1  # diff2html's unified layout
    assert page.locator("#cmp-diff .d2h-file-side-diff").count() == 0
    # The URL is completed with the defaults, so a copied link is explicit.
    assert state(page) == {
        "from": "v01_0_ragged_batch",
        "to": "v02_kv_cache",
        "file": "model.py",
        "view": "unified",
        "context": "3",
    }
    # The changed lines, syntax-highlighted.
    text = code_text(page)
    assert "return y + 2  # changed in v02" in text
    assert page.locator("#cmp-diff .d2h-code-line-ctn.hljs .hljs-keyword").count() > 0


def test_changed_file_list_with_counts(docs_page, docs_server):
    page = docs_page
    page.goto(docs_server + COMPARE)
    wait_ready(page)
    items = page.locator("#cmp-files .file-item:not(.unchanged)")
    rows = {
        items.nth(i).get_attribute("data-path"): items.nth(i).locator(".counts").inner_text()
        for i in range(items.count())
    }
    # jsdiff in the browser and the builder's Myers diff agree on the counts the version page shows.
    version_page = page.context.new_page()
    version_page.goto(docs_server + "torchlet/v02_kv_cache.html")
    for path, counts in rows.items():
        added, removed = re.findall(r"\d+", counts)
        item = version_page.locator(f"ul.file-changes li:has(code:text-is('{path}'))")
        assert item.locator(".add").inner_text() == f"+{added}", path
        assert item.locator(".del").inner_text() == f"−{removed}", path
    version_page.close()
    assert set(rows) == {"cache.py", "llm.py", "model.py", "notes.md"}
    assert rows["model.py"].split() == ["+2", "−1"]
    assert page.locator(".file-item[data-path='cache.py'] .status-added").count() == 1
    assert page.locator(".file-item[data-path='notes.md'] .status-removed").count() == 1
    page.locator(".file-item[data-path='llm.py']").click()
    wait_rendered(page, "hash.includes('file=llm.py')")
    assert page.locator("#compare-app").get_attribute("data-file") == "llm.py"
    assert "class KVCache:" in code_text(page)


def test_switch_view_expand_reload_and_change_language(docs_page, docs_server):
    page = docs_page
    page.goto(docs_server + COMPARE)
    wait_ready(page)

    # Split view: the URL follows.
    page.locator("#cmp-view-split").click()
    wait_rendered(page, "hash.includes('view=split')")
    assert state(page)["view"] == "split"
    assert page.locator("#cmp-diff .d2h-file-side-diff").count() == 2
    assert page.locator("#cmp-view-split").get_attribute("aria-pressed") == "true"

    # The unchanged run above the change is collapsed; expanding it shows its rows.
    assert "def layer_2(x):" not in code_text(page)
    before = context_rows(page)
    gap = page.locator("button.expand-gap[data-gap='0']").first
    assert re.search(r"Show \d+ unchanged lines", gap.inner_text())
    gap.click()
    wait_rendered(page, "hash.includes('expand=0')")
    assert context_rows(page) > before
    assert "def layer_2(x):" in code_text(page)
    assert page.locator("button.expand-gap[data-gap='0']").count() == 0
    expanded = state(page)
    assert expanded == {
        "from": "v01_0_ragged_batch",
        "to": "v02_kv_cache",
        "file": "model.py",
        "view": "split",
        "context": "3",
        "expand": "0",
    }

    # A reload opens the same view.
    rows = context_rows(page)
    page.reload()
    wait_ready(page)
    assert state(page) == expanded
    assert page.locator("#cmp-view-split").get_attribute("aria-pressed") == "true"
    assert page.locator("#cmp-from").input_value() == "v01_0_ragged_batch"
    assert context_rows(page) == rows
    assert "def layer_2(x):" in code_text(page)

    # The language switch keeps the state.
    page.locator("a[data-lang-switch]").click()
    page.wait_for_url(re.compile(r".*/zh/compare\.html#.*"))
    wait_ready(page)
    assert state(page) == expanded
    assert page.locator("#cmp-view-split").inner_text() == "左右对照"
    assert page.locator("#cmp-view-split").get_attribute("aria-pressed") == "true"
    assert page.locator("#cmp-to").input_value() == "v02_kv_cache"
    assert page.locator(".file-item.selected").get_attribute("data-path") == "model.py"
    assert "def layer_2(x):" in code_text(page)
    assert "展开" in page.locator("button.expand-gap").first.inner_text()

    # ... and back.
    page.locator("a[data-lang-switch]").click()
    page.wait_for_url(re.compile(r".*/compare\.html#.*"))
    wait_ready(page)
    assert "/zh/" not in page.url
    assert state(page) == expanded


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_screenshot_of_the_comparison_page(docs_page, docs_server, lang):
    """Writes test-artifacts/docs/compare-LANG.png (DOCS_TEST_ARTIFACTS moves it) to look at."""
    prefix = "zh/" if lang == "zh" else ""
    docs_page.goto(
        docs_server
        + prefix
        + "compare.html#from=v01_0_ragged_batch&to=v02_kv_cache&file=llm.py&view=split"
    )
    wait_ready(docs_page)
    assert docs_page.locator("button.expand-gap").count() > 0
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"compare-{lang}.png"
    docs_page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000


def test_context_and_version_controls(docs_page, docs_server):
    page = docs_page
    page.goto(docs_server + COMPARE)
    wait_ready(page)
    page.locator("#cmp-context").select_option("all")
    wait_rendered(page, "hash.includes('context=all')")
    assert page.locator("button.expand-gap").count() == 0
    assert "def layer_29(x):" in code_text(page) and "def layer_0(x):" in code_text(page)

    page.locator("#cmp-from").select_option("v00_full_recompute")
    wait_rendered(page, "hash.includes('from=v00_full_recompute')")
    wait_ready(page)
    assert state(page)["file"] == "model.py"  # still differs, so it stays open
    assert page.locator("#cmp-files .file-item[data-path='notes.md']").count() == 1

    page.locator("#cmp-swap").click()
    wait_rendered(page, "hash.startsWith('#from=v02_kv_cache')")
    assert state(page)["to"] == "v00_full_recompute"
    page.go_back()
    wait_rendered(page, "hash.startsWith('#from=v00_full_recompute')")
    wait_ready(page)
    assert page.locator("#cmp-from").input_value() == "v00_full_recompute"


@pytest.mark.parametrize(
    "fragment, expected",
    [
        (
            "",
            {
                "from": "v00_full_recompute",
                "to": "v01_0_ragged_batch",
                "file": "llm.py",
                "view": "split",
            },
        ),
        (
            "#to=v02_kv_cache",
            {"from": "v01_0_ragged_batch", "to": "v02_kv_cache", "file": "llm.py"},
        ),
        (
            "#from=nope&to=v02_kv_cache&file=missing.py&view=odd",
            {"from": "v01_0_ragged_batch", "view": "split"},
        ),
    ],
)
def test_default_is_each_version_against_the_one_before(docs_page, docs_server, fragment, expected):
    docs_page.goto(docs_server + "compare.html" + fragment)
    wait_ready(docs_page)
    got = state(docs_page)
    assert {k: got[k] for k in expected} == expected


def test_version_page_links_open_the_preset_comparison(docs_page, docs_server):
    page = docs_page
    page.goto(docs_server + "zh/torchlet/v02_kv_cache.html")
    page.locator("ul.file-changes a:has(code:text-is('model.py'))").click()
    page.wait_for_url(re.compile(r".*/zh/compare\.html#.*"))
    wait_ready(page)
    assert state(page)["from"] == "v01_0_ragged_batch"
    assert state(page)["to"] == "v02_kv_cache"
    assert state(page)["file"] == "model.py"
    assert "return y + 2" in code_text(page)


def test_works_from_file_urls(docs_page, docs_site):
    page = docs_page
    page.goto(
        (docs_site / "compare.html").as_uri()
        + "#from=v01_0_ragged_batch&to=v02_kv_cache&file=llm.py"
    )
    wait_ready(page)
    assert "class KVCache:" in code_text(page)
    page.locator("#cmp-view-unified").click()
    wait_rendered(page, "hash.includes('view=unified')")
    page.locator("a[data-lang-switch]").click()
    page.wait_for_url(re.compile(r"file://.*/zh/compare\.html#.*view=unified.*"))
    wait_ready(page)
    assert page.locator("#cmp-view-unified").get_attribute("aria-pressed") == "true"


def test_every_page_loads_cleanly_in_both_languages(docs_page, docs_server, docs_site):
    """Each page renders with no JavaScript error and no request to another host (see docs_page)."""
    pages = sorted(p.relative_to(docs_site).as_posix() for p in docs_site.rglob("*.html"))
    failed = []
    for path in pages:
        response = docs_page.goto(docs_server + path)
        if response.status != 200 or not docs_page.locator("main h1").count():
            failed.append(path)
    assert not failed
    docs_page.goto(docs_server + "zh/index.html")
    assert docs_page.locator("html").get_attribute("lang") == "zh-CN"
    assert "安装与运行" in docs_page.locator("main").inner_text()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    docs_page.screenshot(path=str(ARTIFACTS / "home-zh.png"), full_page=True)
