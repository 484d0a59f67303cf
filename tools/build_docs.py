#!/usr/bin/env python3
"""Build the bilingual documentation site (English and Simplified Chinese) into docs/_site/.

    python3 tools/build_docs.py [--repo-root DIR] [--source DIR] [--out DIR] [--repo-url URL]

Sources, all under docs/ (see docs/README.md):
  en/*.md, zh/*.md             one page each; every page must exist in both languages
  en/versions/<v>.md, zh/...   optional prose for the torchlet version page of folder <v>
  templates/*.html             Jinja2 page templates
  i18n.json                    interface strings, the same keys in both languages
  static/                      the site's own CSS and JS
  vendor/                      third-party browser libraries (see vendor/VENDORED.md)
  assets/bench/*.png           benchmark plots, written by the benchmark harness (optional)

From the code it reads, at build time: the torchlet/v* folders (sorted by name) and each one's
llm.py docstring, code excerpts named by file and symbol (found with ast, never line ranges),
and the figures table under a "torchlet" heading of BENCHMARKS.md.

Markdown directives, each on its own line unless marked inline:
  [[excerpt: PATH :: SYMBOL]]   code of a function, class, method (Class.method) or assignment.
                                In version prose PATH is inside the version folder; elsewhere,
                                or with a leading "/", it is relative to the repository root.
  [[file: PATH]]                (inline) a repository path, a link only with --repo-url
  [[version: NAME]]             (inline) a link to that version's page, plain text if absent
  [[ladder-table]]  [[benchmark-tables]]  [[benchmark-plots]]  [[compare-app]]

The build fails, naming the page, when a page exists in one language only, when an internal
link points nowhere, when a src or href leaves the site, or when an excerpt names a file or
symbol that does not exist. The site is built in a staging folder and only replaces --out
when every check passes.
"""

from __future__ import annotations

import argparse
import ast
import html
import json
import posixpath
import re
import shutil
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote, unquote, urlencode, urlsplit

try:
    import jinja2
    import markdown
except ImportError as missing:  # plain `python3 tools/build_docs.py`: use the project's venv
    _venv = Path(__file__).resolve().parent.parent / ".venv"
    if (_venv / "bin" / "python").exists() and Path(sys.prefix).resolve() != _venv.resolve():
        import os

        os.execv(str(_venv / "bin" / "python"), [str(_venv / "bin" / "python"), *sys.argv])
    sys.exit(f"build_docs.py needs markdown, jinja2 and pygments ({missing.name} is missing): "
             "run `make setup` or `pip install -e '.[docs]'`")
from markdown.extensions.toc import slugify_unicode
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer, get_lexer_for_filename
from pygments.util import ClassNotFound

LANGS = ("en", "zh")
LANG_PREFIX = {"en": "", "zh": "zh/"}
NAV = ("index", "torchlet", "flashlet", "benchmarks", "compare")
BUILD_MARKER = ".docs-build"
MAX_EMBEDDED_FILE = 512 * 1024  # bytes; larger files are left out of the comparison data
VERSION_ID = re.compile(r"^v(\d+)(?:_(\d+))?(?:_|$)")


class BuildError(Exception):
    """Raised with every problem found, one per line."""


# ----------------------------------------------------------------------------------------------
# torchlet versions


@dataclass
class Version:
    name: str
    folder: Path
    files: dict[str, str]  # posix path inside the folder -> text
    docstring: str | None

    @property
    def label(self) -> str:
        m = VERSION_ID.match(self.name)
        if not m:
            return self.name
        return f"v{m.group(1)}" + (f".{m.group(2)}" if m.group(2) is not None else "")

    @property
    def slug(self) -> str:
        """The part of the name after the version id, e.g. 'kv_cache'."""
        m = VERSION_ID.match(self.name)
        return self.name[m.end() :] if m else self.name

    @property
    def summary(self) -> str | None:
        if not self.docstring:
            return None
        first = " ".join(self.docstring.strip().split("\n\n", 1)[0].split())
        # "v02_kv_cache: remember keys ..." -> "Remember keys ..."
        m = re.match(rf"^`?{re.escape(self.name)}`?\s*[:—-]\s*(.+)$", first)
        if m:
            first = m.group(1)[0].upper() + m.group(1)[1:]
        return first


def read_text_file(path: Path) -> str | None:
    """The file's text with newlines normalised, or None for binary or oversized files."""
    if path.stat().st_size > MAX_EMBEDDED_FILE:
        return None
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None
    if "\x00" in text:
        return None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def discover_versions(repo_root: Path) -> list[Version]:
    base = repo_root / "torchlet"
    if not base.is_dir():
        return []
    versions = []
    for folder in sorted(p for p in base.iterdir() if p.is_dir() and VERSION_ID.match(p.name)):
        files = {}
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder)
            if not path.is_file() or any(
                part.startswith(".") or part == "__pycache__" for part in rel.parts
            ):
                continue
            if path.suffix in (".pyc", ".pyo", ".so"):
                continue
            text = read_text_file(path)
            if text is not None:
                files[rel.as_posix()] = text
        docstring = None
        if "llm.py" in files:
            try:
                docstring = ast.get_docstring(ast.parse(files["llm.py"]))
            except SyntaxError:
                docstring = None
        versions.append(Version(folder.name, folder, files, docstring))
    return versions


def declared_versions(repo_root: Path) -> list[str] | None:
    """torchlet/__init__.py's VERSIONS list, read without importing the package."""
    init = repo_root / "torchlet" / "__init__.py"
    if not init.is_file():
        return None
    try:
        tree = ast.parse(init.read_text(encoding="utf-8"))
    except SyntaxError:
        return None
    for node in tree.body:
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == "VERSIONS" for t in targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None
            return [str(v) for v in value]
    return None


def line_diff_counts(old: list[str], new: list[str]) -> tuple[int, int]:
    """(added, removed) lines of a minimal line diff (Myers), the same counts jsdiff reports."""
    start = 0
    while start < len(old) and start < len(new) and old[start] == new[start]:
        start += 1
    end_o, end_n = len(old), len(new)
    while end_o > start and end_n > start and old[end_o - 1] == new[end_n - 1]:
        end_o -= 1
        end_n -= 1
    a, b = old[start:end_o], new[start:end_n]
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return m, n
    v = {1: 0}
    for d in range(n + m + 1):
        for k in range(-d, d + 1, 2):
            if k == -d or (k != d and v[k - 1] < v[k + 1]):
                x = v[k + 1]
            else:
                x = v[k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x += 1
                y += 1
            v[k] = x
            if x >= n and y >= m:
                common = (n + m - d) // 2
                return m - common, n - common
    raise AssertionError("unreachable")


@dataclass
class FileChange:
    path: str
    status: str  # "added", "removed" or "modified"
    added: int
    removed: int


def changed_files(old: Version, new: Version) -> list[FileChange]:
    changes = []
    for path in sorted(set(old.files) | set(new.files)):
        a, b = old.files.get(path), new.files.get(path)
        if a == b:
            continue
        added, removed = line_diff_counts(
            a.splitlines() if a is not None else [], b.splitlines() if b is not None else []
        )
        status = "added" if a is None else "removed" if b is None else "modified"
        changes.append(FileChange(path, status, added, removed))
    return changes


# ----------------------------------------------------------------------------------------------
# code excerpts


def find_symbol(tree: ast.Module, symbol: str) -> ast.AST | None:
    """A function, class, method or module-level assignment named by a dotted path."""
    scope: ast.AST = tree
    node = None
    for part in symbol.split("."):
        node = None
        for child in getattr(scope, "body", []):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if child.name == part:
                    node = child
            elif isinstance(child, (ast.Assign, ast.AnnAssign)):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    node = child
        if node is None:
            return None
        scope = node
    return node


def node_lines(node: ast.AST) -> tuple[int, int]:
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return start, node.end_lineno


def symbol_source(text: str, node: ast.AST) -> tuple[str, int, int]:
    start, end = node_lines(node)
    lines = text.splitlines()[start - 1 : end]
    return textwrap.dedent("\n".join(lines)), start, end


def code_units(text: str) -> dict[str, str]:
    """Top-level functions and classes, and each class's methods as 'Class.method', with source.

    A class maps to its own lines without its methods (and without blank lines), so that a
    changed method is reported as the method, and a changed class body as the class."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {}
    lines = text.splitlines()
    units: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            units[node.name] = symbol_source(text, node)[0]
        elif isinstance(node, ast.ClassDef):
            units[node.name] = ""  # keeps the class ahead of its methods
            start, end = node_lines(node)
            keep = set(range(start, end + 1))
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    units[f"{node.name}.{child.name}"] = symbol_source(text, child)[0]
                    c_start, c_end = node_lines(child)
                    keep -= set(range(c_start, c_end + 1))
            units[node.name] = "\n".join(lines[i - 1] for i in sorted(keep) if lines[i - 1].strip())
    return units


def changed_symbols(old_text: str | None, new_text: str) -> list[str]:
    """Symbols of new_text that are new or changed since old_text, in file order.

    A new class, or one whose own lines changed, is named whole; otherwise its changed methods."""
    old_units = code_units(old_text) if old_text is not None else {}
    changed = [n for n, src in code_units(new_text).items() if old_units.get(n) != src]
    whole = {n for n in changed if "." not in n}
    return [n for n in changed if "." not in n or n.split(".")[0] not in whole]


# ----------------------------------------------------------------------------------------------
# BENCHMARKS.md


@dataclass
class Table:
    heading: str
    header: list[str]
    rows: list[list[str]]


def strip_md_links(text: str) -> str:
    text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)


def split_row(line: str) -> list[str]:
    line = line.strip()
    if line.startswith("|"):
        line = line[1:]
    if line.endswith("|") and not line.endswith("\\|"):
        line = line[:-1]
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)]


def parse_benchmark_tables(text: str) -> list[Table]:
    """Every markdown table with the heading it sits under."""
    tables = []
    heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            heading = m.group(2)
            i += 1
            continue
        if (
            line.lstrip().startswith("|")
            and i + 1 < len(lines)
            and re.match(r"^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$", lines[i + 1])
        ):
            header = [strip_md_links(c) for c in split_row(line)]
            rows = []
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append([strip_md_links(c) for c in split_row(lines[i])])
                i += 1
            tables.append(Table(heading, header, rows))
            continue
        i += 1
    return tables


def torchlet_table(tables: list[Table]) -> Table | None:
    for table in tables:
        if "torchlet" in table.heading.lower():
            return table
    return None


def row_key(cell: str) -> str:
    cell = re.sub(r"[`*_]+(?=\w)|(?<=\w)[`*]+", "", cell.strip()).strip("`* ")
    return cell.split()[0].lower().replace(".", "_") if cell.split() else ""


def find_version_row(table: Table, version: Version) -> list[str] | None:
    ids = {version.name.lower(), version.label.lower().replace(".", "_")}
    for row in table.rows:
        for cell in row[:2]:
            key = row_key(cell)
            raw = cell.strip().strip("`* ").lower()
            if key in ids or raw == version.name.lower() or raw.startswith(version.name.lower()):
                return row
    return None


# ----------------------------------------------------------------------------------------------
# markdown helpers

CJK = "\u2e80-\u2fff\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
BLOCK_START = re.compile(r"^\s*([-*+>|#]|\d+[.)]|```|~~~|\[\[|$)")


def join_cjk_lines(text: str) -> str:
    """Join the lines of a paragraph where a line ends in a CJK character.

    A browser renders a line break inside a paragraph as a space, which is right between English
    words and wrong between Chinese characters."""
    out: list[str] = []
    fenced = False
    for line in text.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            out.append(line)
            continue
        if (
            not fenced
            and out
            and re.search(f"[{CJK}][\u2014\u2026\u201c\u201d\u2018\u2019]*$", out[-1])
            and not BLOCK_START.match(line)
            and not out[-1].startswith(("    ", "\t"))
            and not line.startswith(("    ", "\t"))
        ):
            out[-1] += line.strip()
        else:
            out.append(line)
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# link checking


class _LinkCollector(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.links: list[tuple[str, str, str]] = []  # (tag, attribute, value)
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name"):
                self.ids.add(value)
            if name in ("href", "src", "action", "poster", "data"):
                self.links.append((tag, name, value))
            if name == "srcset":
                for part in value.split(","):
                    if part.strip():
                        self.links.append((tag, name, part.strip().split()[0]))


def scan_html(path: Path) -> _LinkCollector:
    collector = _LinkCollector()
    collector.feed(path.read_text(encoding="utf-8"))
    return collector


def is_external(url: str) -> bool:
    url = url.strip()
    if url.startswith("//"):
        return True
    scheme = urlsplit(url).scheme.lower()
    return bool(scheme) and scheme != "data"


def check_site(site: Path, repo_url: str | None) -> list[str]:
    """Every src/href stays inside the site and resolves; pages exist in both languages."""
    errors = []
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    scans = {p: scan_html(site / p) for p in pages}
    for page, scan in scans.items():
        for tag, attr, url in scan.links:
            if is_external(url):
                if attr == "href" and tag == "a" and repo_url and url.startswith(repo_url):
                    continue
                errors.append(f"{page}: <{tag} {attr}> points outside the site: {url}")
                continue
            parts = urlsplit(url)
            if parts.scheme == "data":
                continue
            target = unquote(parts.path)
            if target:
                resolved = posixpath.normpath(posixpath.join(posixpath.dirname(page), target))
                if resolved.startswith("../") or resolved == "..":
                    errors.append(f"{page}: link {url} leaves the site")
                    continue
                full = site / resolved
                if full.is_dir():
                    resolved = posixpath.join(resolved, "index.html")
                    full = site / resolved
                if not full.is_file():
                    errors.append(f"{page}: internal link {url} points nowhere ({resolved})")
                    continue
            else:
                resolved = page
            fragment = unquote(parts.fragment)
            if fragment and "=" not in fragment and resolved.endswith(".html"):
                ids = scans[resolved].ids if resolved in scans else scan_html(site / resolved).ids
                if fragment not in ids:
                    errors.append(f"{page}: link {url} names an anchor that {resolved} lacks")
    for css in site.rglob("*.css"):
        text = css.read_text(encoding="utf-8", errors="replace")
        for m in re.finditer(r"url\(\s*['\"]?([^'\")]+)|@import\s+['\"]([^'\"]+)", text):
            url = m.group(1) or m.group(2)
            if is_external(url):
                errors.append(
                    f"{css.relative_to(site).as_posix()}: CSS loads {url} from another host"
                )
    en = {p for p in pages if not p.startswith("zh/")}
    zh = {p[3:] for p in pages if p.startswith("zh/")}
    for p in sorted(en - zh):
        errors.append(f"page {p} exists in English only (no zh/{p})")
    for p in sorted(zh - en):
        errors.append(f"page zh/{p} exists in Chinese only (no {p})")
    return errors


# ----------------------------------------------------------------------------------------------
# the site


@dataclass
class Page:
    key: str  # language-neutral name, e.g. "flashlet" or "torchlet/v02_kv_cache"
    lang: str
    source: Path | None
    kind: str = "page"  # "page" or "version"
    version: Version | None = None

    @property
    def path(self) -> str:
        return f"{LANG_PREFIX[self.lang]}{self.key}.html"


@dataclass
class Builder:
    repo_root: Path
    source: Path
    out: Path
    repo_url: str | None = None
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.repo_url:
            self.repo_url = self.repo_url.rstrip("/")
        self.versions = discover_versions(self.repo_root)
        self.by_name = {v.name: v for v in self.versions}
        self.strings = self._load_strings()
        bench = self.repo_root / "BENCHMARKS.md"
        self.bench_tables = (
            parse_benchmark_tables(bench.read_text(encoding="utf-8")) if bench.is_file() else []
        )
        self.bench_present = bench.is_file()
        self.torchlet_table = torchlet_table(self.bench_tables)
        plots_dir = self.source / "assets" / "bench"
        self.plots = sorted(plots_dir.glob("*.png")) if plots_dir.is_dir() else []
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(self.source / "templates")),
            autoescape=jinja2.select_autoescape(["html"]),
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.formatter = HtmlFormatter(cssclass="highlight")
        self._changes_cache: dict[tuple[str, str], list[FileChange]] = {}

    # -- inputs -------------------------------------------------------------------------------

    def _load_strings(self) -> dict:
        path = self.source / "i18n.json"
        if not path.is_file():
            raise BuildError(f"missing {path}")
        strings = json.loads(path.read_text(encoding="utf-8"))

        def flat(d, prefix=""):
            out = set()
            for k, v in d.items():
                out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
            return out

        keys = {lang: flat(strings.get(lang, {})) for lang in LANGS}
        for lang in LANGS:
            other = LANGS[1 - LANGS.index(lang)]
            for k in sorted(keys[other] - keys[lang]):
                self.errors.append(f"i18n.json: string {k!r} exists in {other} but not in {lang}")
        return strings

    def pages(self) -> list[Page]:
        """Every page in both languages; a source present in one language only is an error."""
        sources: dict[str, dict[str, Path]] = {}
        prose: dict[str, dict[str, Path]] = {}
        for lang in LANGS:
            root = self.source / lang
            if not root.is_dir():
                self.errors.append(f"missing source folder {root}")
                continue
            for md in sorted(root.rglob("*.md")):
                rel = md.relative_to(root).with_suffix("").as_posix()
                if rel.startswith("versions/"):
                    prose.setdefault(rel[len("versions/") :], {})[lang] = md
                else:
                    sources.setdefault(rel, {})[lang] = md
        for kind, table, out in (
            ("page", sources, "{}.html"),
            ("version page", prose, "torchlet/{}.html"),
        ):
            for key, langs in sorted(table.items()):
                for lang in LANGS:
                    if lang not in langs:
                        other = next(iter(langs))
                        have = langs[other].relative_to(self.source).as_posix()
                        missing = self.source / lang / langs[other].relative_to(self.source / other)
                        self.errors.append(
                            f"{kind} {out.format(key)} exists in {other} only: {have} has no "
                            f"{lang} counterpart {missing.relative_to(self.source).as_posix()}"
                        )
        self.version_prose = {k: v for k, v in prose.items() if len(v) == len(LANGS)}
        orphans = sorted(k for k in prose if k not in self.by_name)
        if orphans:
            self.warnings.append(
                "version prose without a torchlet folder yet (not built): " + ", ".join(orphans)
            )
        pages = []
        for lang in LANGS:
            for key, langs in sorted(sources.items()):
                if lang in langs:
                    pages.append(Page(key, lang, langs[lang]))
            for v in self.versions:
                pages.append(
                    Page(f"torchlet/{v.name}", lang, prose.get(v.name, {}).get(lang), "version", v)
                )
        return pages

    def changes(self, old: Version, new: Version) -> list[FileChange]:
        key = (old.name, new.name)
        if key not in self._changes_cache:
            self._changes_cache[key] = changed_files(old, new)
        return self._changes_cache[key]

    def previous(self, v: Version) -> Version | None:
        i = self.versions.index(v)
        return self.versions[i - 1] if i > 0 else None

    def following(self, v: Version) -> Version | None:
        i = self.versions.index(v)
        return self.versions[i + 1] if i + 1 < len(self.versions) else None

    # -- rendering helpers ----------------------------------------------------------------------

    def rel(self, page: Page, target: str) -> str:
        """A relative URL from page to a site path (fragment or query kept)."""
        path, sep, rest = target.partition("#")
        url = posixpath.relpath(path, posixpath.dirname(page.path) or ".")
        return url + (sep + rest if sep else "")

    def lang_path(self, lang: str, key: str) -> str:
        return f"{LANG_PREFIX[lang]}{key}.html"

    def compare_target(
        self, lang: str, old: Version | None, new: Version, file: str | None = None
    ) -> str:
        params = {}
        if old is not None:
            params["from"] = old.name
        params["to"] = new.name
        if file:
            params["file"] = file
        return self.lang_path(lang, "compare") + "#" + urlencode(params, quote_via=quote)

    def file_ref(self, path: str, label: str | None = None) -> str:
        label = html.escape(label or path)
        if self.repo_url:
            href = f"{html.escape(self.repo_url)}/{quote(path)}"
            return f'<a class="path" href="{href}"><code>{label}</code></a>'
        return f'<code class="path">{label}</code>'

    def highlight(self, code: str, filename: str, start: int = 1) -> str:
        try:
            lexer = get_lexer_for_filename(filename, stripnl=False)
        except ClassNotFound:
            lexer = PythonLexer(stripnl=False)
        formatter = HtmlFormatter(cssclass="highlight", linenos="inline", linenostart=start)
        return highlight(code, lexer, formatter)

    def excerpt_html(
        self, repo_path: str, text: str, symbol: str, node: ast.AST, t: dict, open_: bool = True
    ) -> str:
        code, start, end = symbol_source(text, node)
        caption = (
            f'{self.file_ref(repo_path)} <span class="sep">·</span> <code class="symbol">'
            f'{html.escape(symbol)}</code> <span class="lines">'
            f'{html.escape(t["excerpt"]["lines"])} {start}–{end}</span>'
        )
        body = self.highlight(code, repo_path, start)
        return (
            f'<details class="excerpt"{" open" if open_ else ""}><summary>{caption}</summary>'
            f"{body}</details>"
        )

    def resolve_excerpt(
        self, page: Page, path: str, symbol: str, label: str
    ) -> tuple[str, str, ast.AST] | None:
        """(repo path, text, node) for an excerpt directive, recording an error if it fails."""
        if page.version is not None and not path.startswith("/"):
            repo_path = f"torchlet/{page.version.name}/{path}"
        else:
            repo_path = path.lstrip("/")
        file = self.repo_root / repo_path
        if not file.is_file():
            self.errors.append(f"{label}: excerpt names file {repo_path}, which does not exist")
            return None
        if file.suffix != ".py":
            self.errors.append(f"{label}: excerpt file {repo_path} is not a Python file")
            return None
        text = file.read_text(encoding="utf-8")
        try:
            tree = ast.parse(text)
        except SyntaxError as exc:
            self.errors.append(f"{label}: cannot parse {repo_path} for an excerpt: {exc}")
            return None
        node = find_symbol(tree, symbol)
        if node is None:
            self.errors.append(
                f"{label}: excerpt names symbol {symbol!r}, not found in {repo_path}"
            )
            return None
        return repo_path, text, node

    def markdown_page(self, page: Page, t: dict) -> tuple[str, str | None, dict, bool]:
        """(html, first h1 text, meta, uses compare app) of a page's markdown source."""
        text = join_cjk_lines(page.source.read_text(encoding="utf-8"))
        label = f"{page.source.relative_to(self.source).as_posix()} (page {page.path})"
        blocks: dict[str, str] = {}
        inline: dict[str, str] = {}
        uses_compare = False

        def token(store: dict, value: str) -> str:
            key = f"DOCSTOKEN{len(blocks) + len(inline)}X"
            store[key] = value
            return key

        def block_directive(m: re.Match) -> str:
            nonlocal uses_compare
            name, arg = m.group(1).strip(), (m.group(2) or "").strip()
            if name == "excerpt":
                path, sep, symbol = arg.partition("::")
                if not sep or not path.strip() or not symbol.strip():
                    self.errors.append(f"{label}: malformed directive {m.group(0)!r}")
                    return ""
                found = self.resolve_excerpt(page, path.strip(), symbol.strip(), label)
                value = (
                    self.excerpt_html(found[0], found[1], symbol.strip(), found[2], t)
                    if found
                    else ""
                )
            elif name == "ladder-table":
                value = self.ladder_table(page, t)
            elif name == "benchmark-tables":
                value = self.benchmark_tables(t)
            elif name == "benchmark-plots":
                value = self.benchmark_plots(page, t)
            elif name == "compare-app":
                uses_compare = True
                value = self.env.get_template("compare_app.html").render(t=t)
            else:
                self.errors.append(f"{label}: unknown directive {m.group(0)!r}")
                return ""
            return "\n\n" + token(blocks, value) + "\n\n"

        def inline_directive(m: re.Match) -> str:
            name, arg = m.group(1).strip(), m.group(2).strip()
            if name == "file":
                if not (self.repo_root / arg).exists():
                    self.warnings.append(f"{label}: [[file: {arg}]] is not in the tree yet")
                return token(inline, self.file_ref(arg))
            version = self.by_name.get(arg)
            if version is None:
                return token(inline, f"<code>{html.escape(arg)}</code>")
            href = self.rel(page, self.lang_path(page.lang, f"torchlet/{version.name}"))
            return token(
                inline, f'<a href="{html.escape(href)}"><code>{html.escape(arg)}</code></a>'
            )

        text = re.sub(
            r"^[ \t]*\[\[([a-z-]+)(?::([^\]]*))?\]\][ \t]*$",
            lambda m: inline_directive(m)
            if m.group(1) in ("file", "version")
            else block_directive(m),
            text,
            flags=re.M,
        )
        text = re.sub(r"\[\[(file|version):([^\]]+)\]\]", inline_directive, text)
        md = markdown.Markdown(
            extensions=[
                "meta",
                "fenced_code",
                "tables",
                "toc",
                "codehilite",
                "attr_list",
                "sane_lists",
            ],
            extension_configs={
                "codehilite": {"css_class": "highlight", "guess_lang": False},
                "toc": {"slugify": slugify_unicode},
            },
        )
        body = md.convert(text)
        meta = {k: " ".join(v) for k, v in getattr(md, "Meta", {}).items()}
        for key, value in blocks.items():
            body = body.replace(f"<p>{key}</p>", value).replace(key, value)
        for key, value in inline.items():
            body = body.replace(key, value)
        body = self.rewrite_md_links(body)
        title = None
        m = re.search(r"<h1[^>]*>(.*?)</h1>", body, flags=re.S)
        if m:
            title = re.sub(r"<[^>]+>", "", m.group(1)).strip()
        return body, title, meta, uses_compare

    @staticmethod
    def rewrite_md_links(body: str) -> str:
        """Links written to another page's .md source point to its .html output."""

        def fix(m: re.Match) -> str:
            url = m.group(2)
            if is_external(url):
                return m.group(0)
            path, sep, frag = url.partition("#")
            if path.endswith(".md"):
                path = path[:-3] + ".html"
            return f'{m.group(1)}"{path}{sep}{frag}"'

        return re.sub(r'(<a\s[^>]*?href=)"([^"]*)"', fix, body)

    # -- generated blocks -------------------------------------------------------------------------

    def version_title(self, v: Version, lang: str) -> str:
        src = self.version_prose.get(v.name, {}).get(lang)
        if src:
            for line in src.read_text(encoding="utf-8").splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
        return f"{v.label} · {v.slug.replace('_', ' ')}"

    def version_summary(self, v: Version, lang: str) -> str | None:
        src = self.version_prose.get(v.name, {}).get(lang)
        prose_summary = None
        if src:
            m = re.match(r"(?is)^\s*summary:\s*(.+?)\n\s*\n", src.read_text(encoding="utf-8"))
            if m:
                prose_summary = " ".join(m.group(1).split())
        if lang == "en":
            return v.summary or prose_summary
        return prose_summary or v.summary

    def ladder_table(self, page: Page, t: dict) -> str:
        if not self.versions:
            return f'<p class="notice">{html.escape(t["ladder"]["empty"])}</p>'
        return self.env.get_template("ladder_table.html").render(
            t=t,
            rows=[
                {
                    "name": v.name,
                    "label": v.label,
                    "title": self.version_title(v, page.lang),
                    "summary": self.version_summary(v, page.lang) or t["version"]["no_docstring"],
                    "href": self.rel(page, self.lang_path(page.lang, f"torchlet/{v.name}")),
                    "compare": self.rel(page, self.compare_target(page.lang, self.previous(v), v))
                    if self.previous(v)
                    else None,
                    "added": sum(c.added for c in self.changes(self.previous(v), v))
                    if self.previous(v)
                    else None,
                    "removed": sum(c.removed for c in self.changes(self.previous(v), v))
                    if self.previous(v)
                    else None,
                    "nfiles": len(self.changes(self.previous(v), v))
                    if self.previous(v)
                    else len(v.files),
                }
                for v in self.versions
            ],
        )

    def table_html(
        self, table: Table, rows: list[list[str]] | None = None, highlight_row=None
    ) -> str:
        def cell(text: str) -> str:
            rendered = markdown.markdown(text)
            return re.sub(r"^<p>(.*)</p>$", r"\1", rendered, flags=re.S)

        head = "".join(f"<th>{cell(c)}</th>" for c in table.header)
        body = ""
        for row in rows if rows is not None else table.rows:
            cls = ' class="current"' if highlight_row is not None and row is highlight_row else ""
            body += f"<tr{cls}>" + "".join(f"<td>{cell(c)}</td>" for c in row) + "</tr>"
        return (
            f'<div class="table-wrap"><table class="bench"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>"
        )

    def benchmark_tables(self, t: dict) -> str:
        if not self.bench_tables:
            key = "no_file" if not self.bench_present else "no_table"
            return f'<p class="notice">{html.escape(t["bench"][key])}</p>'
        parts = []
        if self.torchlet_table is None:
            parts.append(f'<p class="notice">{html.escape(t["bench"]["no_table"])}</p>')
        for table in self.bench_tables:
            title = html.escape(strip_md_links(table.heading) or "BENCHMARKS.md")
            parts.append(f'<h3 class="bench-heading">{title}</h3>' + self.table_html(table))
        note = html.escape(t["bench"]["source_note"])
        parts.append(f'<p class="source-note">{note} {self.file_ref("BENCHMARKS.md")}</p>')
        return "\n".join(parts)

    def benchmark_plots(self, page: Page, t: dict) -> str:
        if not self.plots:
            return f'<p class="notice">{html.escape(t["bench"]["no_plots"])}</p>'
        figs = []
        for plot in self.plots:
            src = self.rel(page, f"assets/bench/{plot.name}")
            caption = plot.stem.replace("_", " ").replace("-", " ")
            figs.append(
                f'<figure class="plot"><img src="{html.escape(src)}" alt="{html.escape(caption)}" '
                f'loading="lazy"><figcaption>{html.escape(caption)}</figcaption></figure>'
            )
        return '<div class="plots">' + "\n".join(figs) + "</div>"

    def version_bench(self, v: Version, t: dict) -> str:
        if self.torchlet_table is None:
            key = "no_file" if not self.bench_present else "no_table"
            return f'<p class="notice">{html.escape(t["bench"][key])}</p>'
        row = find_version_row(self.torchlet_table, v)
        if row is None:
            return f'<p class="notice">{html.escape(t["bench"]["no_row"])}</p>'
        rows = []
        prev = self.previous(v)
        prev_row = find_version_row(self.torchlet_table, prev) if prev else None
        if prev_row is not None:
            rows.append(prev_row)
        rows.append(row)
        return self.table_html(self.torchlet_table, rows, highlight_row=row)

    def auto_excerpts(self, page: Page, t: dict) -> list[str]:
        """Excerpts of the symbols this version adds or changes (for the first: llm.py's)."""
        v = page.version
        prev = self.previous(v)
        items = []
        if prev is None:
            if "llm.py" in v.files:
                items = [("llm.py", s) for s in code_units(v.files["llm.py"]) if "." not in s]
        else:
            for change in self.changes(prev, v):
                if change.status == "removed" or not change.path.endswith(".py"):
                    continue
                for symbol in changed_symbols(prev.files.get(change.path), v.files[change.path]):
                    items.append((change.path, symbol))
        html_parts = []
        for i, (path, symbol) in enumerate(items):
            text = v.files[path]
            node = find_symbol(ast.parse(text), symbol)
            if node is None:
                continue
            html_parts.append(
                self.excerpt_html(f"torchlet/{v.name}/{path}", text, symbol, node, t, open_=i < 3)
            )
        return html_parts

    # -- pages ------------------------------------------------------------------------------------

    def nav(self, page: Page, t: dict, available: set[str]) -> list[dict]:
        items = []
        for key in NAV:
            if key not in available:
                continue
            current = page.key == key or (key == "torchlet" and page.kind == "version")
            items.append(
                {
                    "href": self.rel(page, self.lang_path(page.lang, key)),
                    "label": t["nav"][key],
                    "current": current,
                }
            )
        return items

    def render_page(self, page: Page, available: set[str]) -> str:
        t = self.strings[page.lang]
        other = LANGS[1 - LANGS.index(page.lang)]
        context = {
            "t": t,
            "lang": page.lang,
            "page_key": page.key,
            "assets": self.rel(page, "assets/x")[:-1],
            "home": self.rel(page, self.lang_path(page.lang, "index")),
            "switch_href": self.rel(page, self.lang_path(other, page.key)),
            "switch_lang": other,
            "switch_label": self.strings[other]["lang"]["name"],
            "nav": self.nav(page, t, available),
            "vendor_versions": {"diff": "8.0.4", "diff2html": "3.4.56", "hljs": "11.11.1"},
            "uses_compare": False,
        }
        if page.kind == "version":
            return self.render_version(page, t, context)
        body, title, _meta, uses_compare = self.markdown_page(page, t)
        context.update(
            title=title or page.key,
            content=body,
            uses_compare=uses_compare,
            compare_strings=json.dumps(t["compare"], ensure_ascii=True).replace("</", "<\\/"),
            page_class=f"page-{page.key.replace('/', '-')}" + (" wide" if uses_compare else ""),
        )
        return self.env.get_template("page.html").render(**context)

    def render_version(self, page: Page, t: dict, context: dict) -> str:
        v = page.version
        prev, nxt = self.previous(v), self.following(v)
        prose, title = None, None
        if page.source is not None:
            prose, title, _meta, _ = self.markdown_page(page, t)
            prose = re.sub(r"<h1[^>]*>.*?</h1>", "", prose, count=1, flags=re.S)
        excerpts = self.auto_excerpts(page, t)
        changes = self.changes(prev, v) if prev else []
        files = [
            {
                "path": c.path,
                "status": c.status,
                "status_label": t["version"]["status"][c.status],
                "added": c.added,
                "removed": c.removed,
                "href": self.rel(page, self.compare_target(page.lang, prev, v, c.path)),
            }
            for c in changes
        ]

        def link(other_v):
            if other_v is None:
                return None
            return {
                "href": self.rel(page, self.lang_path(page.lang, f"torchlet/{other_v.name}")),
                "title": self.version_title(other_v, page.lang),
                "name": other_v.name,
            }

        context.update(
            title=title or self.version_title(v, page.lang),
            version=v,
            summary=self.version_summary(v, page.lang),
            docstring=v.docstring,
            prose=prose,
            bench=self.version_bench(v, t),
            files=files,
            all_files=sorted(v.files),
            compare_href=self.rel(page, self.compare_target(page.lang, prev, v)) if prev else None,
            prev=link(prev),
            next=link(nxt),
            excerpts=excerpts,
            llm_path=f"torchlet/{v.name}/llm.py",
            llm_ref=self.file_ref(f"torchlet/{v.name}/llm.py"),
            folder_ref=self.file_ref(f"torchlet/{v.name}/"),
            ladder_href=self.rel(page, self.lang_path(page.lang, "torchlet")),
            page_class="page-version",
        )
        return self.env.get_template("version.html").render(**context)

    def compare_data(self) -> str:
        blobs: list[str] = []
        index: dict[str, int] = {}
        files = {}
        for v in self.versions:
            entry = {}
            for path, text in v.files.items():
                if text not in index:
                    index[text] = len(blobs)
                    blobs.append(text)
                entry[path] = index[text]
            files[v.name] = entry
        data = {
            "versions": [
                {"name": v.name, "label": v.label, "summary": v.summary or ""}
                for v in self.versions
            ],
            "files": files,
            "blobs": blobs,
        }
        return (
            "window.TORCHLET_DATA = "
            + json.dumps(data, ensure_ascii=True, separators=(",", ":"))
            + ";\n"
        )

    # -- the build --------------------------------------------------------------------------------

    def build(self) -> None:
        pages = self.pages()
        available = {p.key for p in pages}
        declared = declared_versions(self.repo_root)
        if declared is not None and declared != [v.name for v in self.versions]:
            self.warnings.append(
                "torchlet/__init__.py VERSIONS differs from the torchlet/v* folders; "
                "the site follows the folders"
            )
        self.out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.staging-", dir=self.out.parent))
        try:
            if not self.errors:
                for page in pages:
                    html_text = self.render_page(page, available)
                    dest = staging / page.path
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_text(html_text, encoding="utf-8")
                self.write_assets(staging)
                self.errors.extend(check_site(staging, self.repo_url))
            if self.errors:
                raise BuildError("\n".join(dict.fromkeys(self.errors)))
            self.replace_out(staging)
        finally:
            if staging.exists():
                shutil.rmtree(staging)

    def write_assets(self, staging: Path) -> None:
        assets = staging / "assets"
        shutil.copytree(self.source / "static", assets)
        vendor = self.source / "vendor"
        shutil.copytree(vendor, assets / "vendor", ignore=shutil.ignore_patterns("*.sh", ".*"))
        (assets / "pygments.css").write_text(
            self.formatter.get_style_defs(".highlight"), encoding="utf-8"
        )
        (assets / "torchlet-data.js").write_text(self.compare_data(), encoding="utf-8")
        if self.plots:
            (assets / "bench").mkdir()
            for plot in self.plots:
                shutil.copy2(plot, assets / "bench" / plot.name)
        (staging / ".nojekyll").write_text("")
        (staging / BUILD_MARKER).write_text("built by tools/build_docs.py\n")

    def replace_out(self, staging: Path) -> None:
        if self.out.exists():
            if not (self.out / BUILD_MARKER).is_file() and any(self.out.iterdir()):
                raise BuildError(
                    f"{self.out} exists and was not built by this tool; refusing to replace it"
                )
            shutil.rmtree(self.out)
        staging.rename(self.out)


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repo-root", type=Path, default=here, help="repository to document (default: this one)"
    )
    parser.add_argument(
        "--source", type=Path, default=None, help="docs sources (default: REPO_ROOT/docs)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default: SOURCE/_site)"
    )
    parser.add_argument(
        "--repo-url",
        default=None,
        help="base URL that repository paths are appended to, e.g. "
        "https://github.com/OWNER/REPO/blob/main; without it file references are plain code paths",
    )
    args = parser.parse_args(argv)
    repo_root = args.repo_root.resolve()
    source = (args.source or repo_root / "docs").resolve()
    out = (args.out or source / "_site").resolve()
    try:
        builder = Builder(repo_root, source, out, args.repo_url)
        builder.build()
    except BuildError as exc:
        print("build_docs: the build failed:", file=sys.stderr)
        for line in str(exc).splitlines():
            print(f"  - {line}", file=sys.stderr)
        return 1
    for warning in dict.fromkeys(builder.warnings):
        print(f"build_docs: note: {warning}", file=sys.stderr)
    n_pages = sum(1 for _ in out.rglob("*.html"))
    print(
        f"build_docs: built {n_pages} pages ({len(builder.versions)} torchlet versions) into {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
