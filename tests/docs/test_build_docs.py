"""tools/build_docs.py: what it builds, and each way it must refuse to build."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from docs_helpers import BUILDER, FIXTURE_VERSIONS, REPO, make_fixture_repo, run_builder


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_docs", BUILDER)
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_docs"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


bd = _load_builder()


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls: list[tuple[str, str]] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href") and value is not None:
                self.urls.append((name, value))
            if name == "id" and value:
                self.ids.add(value)


def parse(path: Path) -> _Links:
    links = _Links()
    links.feed(path.read_text(encoding="utf-8"))
    return links


def html_pages(site: Path) -> list[str]:
    return sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))


def text_of(path: Path) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", path.read_text(encoding="utf-8")))


def build(repo: Path, out: Path, *extra) -> "subprocess.CompletedProcess":  # noqa: F821
    return run_builder("--repo-root", repo, "--out", out, *extra)


# ---- the built site -----------------------------------------------------------------------------


def test_both_languages_are_built_page_for_page(docs_site):
    pages = html_pages(docs_site)
    assert "index.html" in pages and "zh/index.html" in pages
    english = {p for p in pages if not p.startswith("zh/")}
    chinese = {p[3:] for p in pages if p.startswith("zh/")}
    assert english == chinese
    for key in ("index", "torchlet", "flashlet", "benchmarks", "compare"):
        assert f"{key}.html" in english
    for version in FIXTURE_VERSIONS:
        assert f"torchlet/{version}.html" in english
    assert '<html lang="zh-CN">' in (docs_site / "zh" / "index.html").read_text(encoding="utf-8")
    assert '<html lang="en">' in (docs_site / "index.html").read_text(encoding="utf-8")


def test_every_internal_link_resolves(docs_site):
    broken = []
    for page in html_pages(docs_site):
        for _attr, url in parse(docs_site / page).urls:
            parts = urlsplit(url)
            if parts.scheme:
                continue  # external or data: URLs are checked by the next test
            target = (
                (docs_site / page).parent / unquote(parts.path) if parts.path else docs_site / page
            )
            if target.is_dir():
                target = target / "index.html"
            if (
                not target.resolve().is_file()
                or docs_site.resolve() not in target.resolve().parents
            ):
                broken.append(f"{page}: {url}")
                continue
            if parts.fragment and "=" not in parts.fragment and target.suffix == ".html":
                if unquote(parts.fragment) not in parse(target).ids:
                    broken.append(f"{page}: {url} (no such anchor)")
    assert not broken, "\n".join(broken)


def test_no_src_or_href_leaves_the_site(docs_site):
    external = []
    for page in html_pages(docs_site):
        for attr, url in parse(docs_site / page).urls:
            scheme = urlsplit(url).scheme
            if url.startswith("//") or (scheme and scheme != "data"):
                external.append(f"{page}: {attr}={url}")
    for css in docs_site.rglob("*.css"):
        for m in re.finditer(r"url\(\s*['\"]?([^'\")]+)", css.read_text(encoding="utf-8")):
            if re.match(r"^(https?:)?//", m.group(1)):
                external.append(f"{css}: {m.group(1)}")
    assert not external, "\n".join(external)


def test_language_switch_points_at_the_same_page(docs_site):
    for page in html_pages(docs_site):
        html = (docs_site / page).read_text(encoding="utf-8")
        m = re.search(r'<a class="lang-switch"[^>]*href="([^"]+)"', html)
        assert m, page
        target = ((docs_site / page).parent / m.group(1)).resolve()
        other = page[3:] if page.startswith("zh/") else "zh/" + page
        assert target == (docs_site / other).resolve(), page


def test_version_pages_carry_docstring_figures_compare_links_and_excerpts(docs_site):
    page = (docs_site / "torchlet" / "v02_kv_cache.html").read_text(encoding="utf-8")
    # The docstring of the version's llm.py.
    assert "v02_kv_cache: keys and values of past tokens are kept between steps." in page
    # Its BENCHMARKS.md row next to the previous version's.
    assert "1234.5" in page and "288.1" in page and "41.5" not in page
    # Changed files, with counts, each linking to the comparison preset to this version vs previous.
    assert (
        'href="../compare.html#from=v01_0_ragged_batch&amp;to=v02_kv_cache&amp;file=model.py"'
        in page
    )
    assert re.search(r"<code>model.py</code></a>.*?\+2</span> <span class=\"del\">−1<", page, re.S)
    assert re.search(r"<code>notes.md</code></a>.*?removed", page, re.S)
    # Excerpts of what changed, cut out by symbol: the new class and the changed function.
    assert "KVCache" in page and "layer_15" in page
    assert "changed in v02" in page
    assert "layer_14" not in page  # unchanged code is not excerpted


def test_chinese_version_page_uses_chinese_prose(docs_site):
    page = text_of(docs_site / "zh" / "torchlet" / "v02_kv_cache.html")
    assert "KV 缓存" in page and "预填充" in page
    assert "打开与上一版的逐行对比" in page


def test_compare_data_embeds_every_version_file(docs_site, docs_fixture_repo):
    js = (docs_site / "assets" / "torchlet-data.js").read_text(encoding="utf-8")
    data = json.loads(js[js.index("=") + 1 : js.rindex(";")])
    assert [v["name"] for v in data["versions"]] == list(FIXTURE_VERSIONS)
    for version in FIXTURE_VERSIONS:
        folder = docs_fixture_repo / "torchlet" / version
        files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        assert set(data["files"][version]) == files
        for path, blob in data["files"][version].items():
            assert data["blobs"][blob] == (folder / path).read_text()


def test_ladder_table_and_benchmarks_page(docs_site):
    ladder = (docs_site / "torchlet.html").read_text(encoding="utf-8")
    for version in FIXTURE_VERSIONS:
        assert f'href="torchlet/{version}.html"' in ladder
    bench = (docs_site / "benchmarks.html").read_text(encoding="utf-8")
    assert "1234.5" in bench and "torchlet progression" in bench
    assert 'src="assets/bench/torchlet_throughput.png"' in bench
    assert (docs_site / "assets" / "bench" / "torchlet_throughput.png").is_file()
    zh_bench = (docs_site / "zh" / "benchmarks.html").read_text(encoding="utf-8")
    assert 'src="../assets/bench/torchlet_throughput.png"' in zh_bench


def test_vendored_libraries_and_licenses_ship_with_the_site(docs_site):
    for path in (
        "vendor/diff/diff.min.js",
        "vendor/diff/LICENSE",
        "vendor/diff2html/diff2html-ui-base.min.js",
        "vendor/diff2html/diff2html.min.css",
        "vendor/diff2html/LICENSE.md",
        "vendor/highlight.js/highlight.min.js",
        "vendor/highlight.js/LICENSE",
    ):
        assert (docs_site / "assets" / path).is_file(), path
    vendored = (REPO / "docs" / "vendor" / "VENDORED.md").read_text(encoding="utf-8")
    for name, version in (
        ("diff", "8.0.4"),
        ("diff2html", "3.4.56"),
        ("@highlightjs/cdn-assets", "11.11.1"),
    ):
        assert name in vendored and version in vendored


# ---- the build follows the code ---------------------------------------------------------------


def test_a_new_version_folder_gets_its_pages_on_the_next_build(docs_scratch_repo, tmp_path):
    new = docs_scratch_repo / "torchlet" / "v03_request_states"
    shutil.copytree(docs_scratch_repo / "torchlet" / "v02_kv_cache", new)
    llm = new / "llm.py"
    llm.write_text(
        llm.read_text().replace(
            "v02_kv_cache: keys and values of past tokens are kept between steps.",
            "v03_request_states: every prompt becomes a request with a status.",
        )
        + "\n\nclass Request:\n    status = 'waiting'\n"
    )
    out = tmp_path / "site"
    proc = build(docs_scratch_repo, out)
    assert proc.returncode == 0, proc.stderr
    for prefix in ("", "zh/"):
        assert (out / f"{prefix}torchlet/v03_request_states.html").is_file()
        assert "v03_request_states" in (out / f"{prefix}torchlet.html").read_text(encoding="utf-8")
    page = (out / "torchlet" / "v03_request_states.html").read_text(encoding="utf-8")
    assert "every prompt becomes a request with a status" in page
    assert '<span class="nc">Request</span>' in page
    v02 = (out / "torchlet" / "v02_kv_cache.html").read_text(encoding="utf-8")
    assert 'href="v03_request_states.html"' in v02  # the "next" link appears on its neighbour


def test_a_code_change_shows_up_in_the_excerpt(docs_scratch_repo, tmp_path):
    model = docs_scratch_repo / "torchlet" / "v02_kv_cache" / "model.py"
    model.write_text(
        model.read_text().replace("# changed in v02", "# edited after the docs were written")
    )
    out = tmp_path / "site"
    assert build(docs_scratch_repo, out).returncode == 0
    page = (out / "torchlet" / "v02_kv_cache.html").read_text(encoding="utf-8")
    assert "edited after the docs were written" in page and "changed in v02" not in page


def test_without_benchmarks_or_plots_the_pages_say_so(docs_scratch_repo, tmp_path):
    (docs_scratch_repo / "BENCHMARKS.md").unlink()
    shutil.rmtree(docs_scratch_repo / "docs" / "assets")
    out = tmp_path / "site"
    proc = build(docs_scratch_repo, out)
    assert proc.returncode == 0, proc.stderr
    assert "Figures are not yet recorded" in text_of(out / "torchlet" / "v02_kv_cache.html")
    assert "Figures are not yet recorded" in text_of(out / "benchmarks.html")
    assert "Plots are not yet recorded" in text_of(out / "benchmarks.html")
    assert "暂无性能数据" in text_of(out / "zh" / "benchmarks.html")
    assert "暂无图表" in text_of(out / "zh" / "benchmarks.html")


def test_builds_with_no_torchlet_versions_yet(docs_scratch_repo, tmp_path):
    shutil.rmtree(docs_scratch_repo / "torchlet")
    out = tmp_path / "site"
    proc = build(docs_scratch_repo, out)
    assert proc.returncode == 0, proc.stderr
    assert "No torchlet version folder exists yet" in text_of(out / "torchlet.html")
    assert (out / "zh" / "compare.html").is_file()


def test_the_real_repository_builds(tmp_path):
    out = tmp_path / "site"
    proc = build(REPO, out)
    assert proc.returncode == 0, proc.stderr
    assert (out / "index.html").is_file() and (out / "zh" / "index.html").is_file()
    for folder in sorted((REPO / "torchlet").glob("v*")):
        if folder.is_dir() and bd.VERSION_ID.match(folder.name):
            assert (out / "torchlet" / f"{folder.name}.html").is_file()
            assert (out / "zh" / "torchlet" / f"{folder.name}.html").is_file()


def test_repo_url_turns_file_references_into_links(docs_scratch_repo, tmp_path):
    out = tmp_path / "site"
    url = "https://example.invalid/flashlet/blob/main"
    proc = build(docs_scratch_repo, out, "--repo-url", url)
    assert proc.returncode == 0, proc.stderr
    assert f'href="{url}/flashlet/kvcache/kv_pool.py"' in (out / "flashlet.html").read_text(
        encoding="utf-8"
    )


# ---- the build refuses ---------------------------------------------------------------------------


def assert_fails(proc, *needles):
    assert proc.returncode != 0, f"the build should have failed:\n{proc.stdout}\n{proc.stderr}"
    for needle in needles:
        assert needle in proc.stderr, f"{needle!r} not in:\n{proc.stderr}"


def test_a_page_in_one_language_only_fails(docs_scratch_repo, tmp_path):
    (docs_scratch_repo / "docs" / "zh" / "flashlet.md").unlink()
    assert_fails(build(docs_scratch_repo, tmp_path / "site"), "flashlet.html", "zh/flashlet.md")


def test_a_new_english_only_page_fails(docs_scratch_repo, tmp_path):
    (docs_scratch_repo / "docs" / "en" / "faq.md").write_text("# FAQ\n\nQuestions.\n")
    assert_fails(build(docs_scratch_repo, tmp_path / "site"), "faq.html", "exists in en only")


def test_version_prose_in_one_language_only_fails(docs_scratch_repo, tmp_path):
    (docs_scratch_repo / "docs" / "zh" / "versions" / "v02_kv_cache.md").unlink()
    assert_fails(build(docs_scratch_repo, tmp_path / "site"), "torchlet/v02_kv_cache.html")


def test_a_broken_internal_link_fails(docs_scratch_repo, tmp_path):
    index = docs_scratch_repo / "docs" / "en" / "index.md"
    index.write_text(index.read_text() + "\nSee [the missing page](nowhere.md).\n")
    assert_fails(build(docs_scratch_repo, tmp_path / "site"), "index.html", "nowhere.html")


def test_a_link_to_a_missing_anchor_fails(docs_scratch_repo, tmp_path):
    index = docs_scratch_repo / "docs" / "zh" / "index.md"
    index.write_text(index.read_text() + "\n见 [某节](flashlet.md#no-such-section)。\n")
    assert_fails(build(docs_scratch_repo, tmp_path / "site"), "zh/index.html", "no-such-section")


def test_an_external_url_fails(docs_scratch_repo, tmp_path):
    page = docs_scratch_repo / "docs" / "en" / "benchmarks.md"
    page.write_text(page.read_text() + "\n![chart](https://example.com/chart.png)\n")
    assert_fails(
        build(docs_scratch_repo, tmp_path / "site"),
        "benchmarks.html",
        "https://example.com/chart.png",
    )


def test_an_excerpt_of_a_missing_symbol_fails(docs_scratch_repo, tmp_path):
    prose = docs_scratch_repo / "docs" / "en" / "versions" / "v02_kv_cache.md"
    prose.write_text(prose.read_text() + "\n[[excerpt: llm.py :: KVCache.evict]]\n")
    assert_fails(
        build(docs_scratch_repo, tmp_path / "site"),
        "en/versions/v02_kv_cache.md",
        "torchlet/v02_kv_cache.html",
        "'KVCache.evict'",
    )


def test_an_excerpt_of_a_missing_file_fails(docs_scratch_repo, tmp_path):
    page = docs_scratch_repo / "docs" / "zh" / "flashlet.md"
    page.write_text(page.read_text() + "\n[[excerpt: flashlet/no_such_file.py :: run]]\n")
    assert_fails(
        build(docs_scratch_repo, tmp_path / "site"), "zh/flashlet.html", "flashlet/no_such_file.py"
    )


def test_an_excerpt_whose_symbol_was_renamed_in_the_code_fails(docs_scratch_repo, tmp_path):
    pool = docs_scratch_repo / "flashlet" / "kvcache" / "kv_pool.py"
    pool.write_text(pool.read_text().replace("class PageAllocator", "class PageFreeList"))
    assert_fails(
        build(docs_scratch_repo, tmp_path / "site"), "flashlet.html", "PageAllocator.allocate"
    )


def test_a_failed_build_leaves_the_previous_site_in_place(docs_scratch_repo, tmp_path):
    out = tmp_path / "site"
    assert build(docs_scratch_repo, out).returncode == 0
    before = (out / "index.html").read_text(encoding="utf-8")
    (docs_scratch_repo / "docs" / "zh" / "index.md").unlink()
    assert build(docs_scratch_repo, out).returncode != 0
    assert (out / "index.html").read_text(encoding="utf-8") == before
    assert not list(tmp_path.glob(".site.staging-*"))


def test_refuses_to_replace_a_folder_it_did_not_build(docs_scratch_repo, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_fails(build(docs_scratch_repo, out), "refusing")
    assert (out / "keep.txt").read_text() == "mine"


def test_builds_from_an_explicit_source_folder(docs_scratch_repo, tmp_path):
    source = tmp_path / "elsewhere"
    shutil.move(str(docs_scratch_repo / "docs"), source)
    out = tmp_path / "site"
    proc = run_builder("--repo-root", docs_scratch_repo, "--source", source, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert (out / "zh" / "compare.html").is_file()


# ---- pieces of the builder -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "old, new",
    [
        ([], ["a"]),
        (["a"], []),
        (["a", "b", "c"], ["a", "x", "c"]),
        (["a", "b", "c", "d"], ["d", "c", "b", "a"]),
        (list("abcabba"), list("cbabac")),
    ],
)
def test_line_diff_counts_are_minimal(old, new):
    added, removed = bd.line_diff_counts(old, new)
    # A minimal diff keeps a longest common subsequence; check its length by brute force.
    lcs = [[0] * (len(new) + 1) for _ in range(len(old) + 1)]
    for i in range(len(old)):
        for j in range(len(new)):
            lcs[i + 1][j + 1] = (
                lcs[i][j] + 1 if old[i] == new[j] else max(lcs[i][j + 1], lcs[i + 1][j])
            )
    common = lcs[-1][-1]
    assert (added, removed) == (len(new) - common, len(old) - common)


def test_find_symbol_finds_methods_classes_functions_and_assignments():
    import ast

    tree = ast.parse(
        "X = 1\n\nclass A:\n    @staticmethod\n    def f():\n        pass\n\n"
        "def g():\n    return 2\n"
    )
    assert bd.find_symbol(tree, "A.f").name == "f"
    assert bd.find_symbol(tree, "g").name == "g"
    assert isinstance(bd.find_symbol(tree, "X"), ast.Assign)
    assert bd.find_symbol(tree, "A.g") is None
    assert bd.find_symbol(tree, "B") is None
    assert bd.node_lines(bd.find_symbol(tree, "A.f")) == (4, 6)  # the decorator is included


def test_changed_symbols_names_new_and_changed_code_only():
    old = (
        "class A:\n    def f(self):\n        return 1\n\n    def g(self):\n        return 2\n\n"
        "def h():\n    pass\n"
    )
    new = old.replace("return 2", "return 3") + "\ndef k():\n    pass\n"
    assert bd.changed_symbols(old, new) == ["A.g", "k"]
    assert bd.changed_symbols(None, "class B:\n    def f(self):\n        pass\n") == ["B"]


def test_benchmark_table_rows_match_versions_by_name_or_label():
    tables = bd.parse_benchmark_tables(
        "# Results\n\n## torchlet ladder\n\n| Version | tok/s |\n|---|---|\n"
        "| v00 | 1 |\n| **v01.1** split | 2 |\n| `v02_kv_cache` | 3 |\n"
    )
    table = bd.torchlet_table(tables)
    v = lambda name: bd.Version(name, Path(name), {}, None)  # noqa: E731
    assert bd.find_version_row(table, v("v00_full_recompute"))[1] == "1"
    assert bd.find_version_row(table, v("v01_1_split_gqa"))[1] == "2"
    assert bd.find_version_row(table, v("v02_kv_cache"))[1] == "3"
    assert bd.find_version_row(table, v("v01_0_ragged_batch")) is None


def test_chinese_lines_are_joined_without_spaces_but_english_and_lists_are_not():
    text = (
        "第一行，\n第二行。\n\n- 列表\n- 项目\n\nEnglish line\nnext line\n```\n代码，\n保留\n```\n"
    )
    joined = bd.join_cjk_lines(text)
    assert "第一行，第二行。" in joined
    assert "- 列表\n- 项目" in joined
    assert "English line\nnext line" in joined
    assert "代码，\n保留" in joined


def test_fixture_repo_is_self_contained(tmp_path):
    root = make_fixture_repo(tmp_path / "r")
    assert sorted(p.name for p in (root / "torchlet").iterdir() if p.is_dir()) == list(
        FIXTURE_VERSIONS
    )
