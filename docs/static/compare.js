/* The version comparison page.
 *
 * The builder embeds every torchlet version's files in assets/torchlet-data.js
 * (window.TORCHLET_DATA: versions, files[version][path] -> blob index, blobs). This script
 * diffs two versions in the browser with jsdiff, cuts the result into hunks itself (so that
 * each collapsed run of unchanged lines can be expanded on its own), and hands the hunks to
 * diff2html as a DiffFile, which renders them split or unified with highlight.js colouring.
 *
 * The whole view lives in the URL hash, so a copied link opens the same view:
 *   #from=V&to=V&file=PATH&view=split|unified&context=3|10|25|all&expand=G,G
 * where expand lists the collapsed runs (gaps, numbered from the top) the reader opened.
 */
(function () {
  "use strict";

  var DATA = window.TORCHLET_DATA || { versions: [], files: {}, blobs: [] };
  var T = JSON.parse(document.getElementById("compare-strings").textContent);
  var CONTEXTS = ["3", "10", "25", "all"];
  var VIEWS = ["split", "unified"];
  var NAMES = DATA.versions.map(function (v) { return v.name; });

  var app = document.getElementById("compare-app");
  var els = {
    from: document.getElementById("cmp-from"),
    to: document.getElementById("cmp-to"),
    swap: document.getElementById("cmp-swap"),
    context: document.getElementById("cmp-context"),
    expandAll: document.getElementById("cmp-expand-all"),
    summary: document.getElementById("cmp-summary"),
    files: document.getElementById("cmp-files"),
    diff: document.getElementById("cmp-diff"),
    views: app.querySelectorAll("button[data-view]")
  };
  var current = null;

  function fmt(s, vars) {
    return s.replace(/\{(\w+)\}/g, function (m, k) { return k in vars ? vars[k] : m; });
  }

  function esc(s) {
    return String(s).replace(/[&<>"']/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c];
    });
  }

  // ---- the two versions' files ---------------------------------------------------------------

  function fileText(version, path) {
    var i = (DATA.files[version] || {})[path];
    return i === undefined ? null : DATA.blobs[i];
  }

  function withFinalNewline(text) {
    return text && text.charAt(text.length - 1) !== "\n" ? text + "\n" : text;
  }

  /* One entry per line: t is " ", "-" or "+"; o and n are old and new line numbers. */
  function lineOps(oldText, newText) {
    var parts = window.Diff.diffLines(withFinalNewline(oldText || ""), withFinalNewline(newText || ""));
    var ops = [];
    var o = 1;
    var n = 1;
    parts.forEach(function (part) {
      var lines = part.value.split("\n");
      lines.pop(); // the value ends with a newline
      lines.forEach(function (line) {
        if (part.added) ops.push({ t: "+", s: line, n: n++ });
        else if (part.removed) ops.push({ t: "-", s: line, o: o++ });
        else ops.push({ t: " ", s: line, o: o++, n: n++ });
      });
    });
    return ops;
  }

  var opsCache = {};
  function fileDiff(from, to, path) {
    var key = from + "\u0000" + to + "\u0000" + path;
    if (!opsCache[key]) {
      var a = fileText(from, path);
      var b = fileText(to, path);
      var ops = a === b ? [] : lineOps(a, b);
      var added = 0;
      var removed = 0;
      ops.forEach(function (op) {
        if (op.t === "+") added++;
        else if (op.t === "-") removed++;
      });
      opsCache[key] = {
        path: path,
        same: a === b,
        status: a === null ? "added" : b === null ? "removed" : "modified",
        ops: ops,
        added: added,
        removed: removed
      };
    }
    return opsCache[key];
  }

  var listCache = {};
  function fileList(from, to) {
    var key = from + "\u0000" + to;
    if (!listCache[key]) {
      var paths = {};
      Object.keys(DATA.files[from] || {}).forEach(function (p) { paths[p] = true; });
      Object.keys(DATA.files[to] || {}).forEach(function (p) { paths[p] = true; });
      var changed = [];
      var unchanged = [];
      Object.keys(paths).sort().forEach(function (p) {
        if (fileText(from, p) === fileText(to, p)) unchanged.push(p);
        else changed.push(fileDiff(from, to, p));
      });
      listCache[key] = { changed: changed, unchanged: unchanged };
    }
    return listCache[key];
  }

  // ---- hunks with collapsible gaps -----------------------------------------------------------

  /* Lines farther than `context` from a change are hidden in gaps, numbered from the top;
   * a gap listed in `expanded` is shown. Returns the visible hunks, each with the gap before
   * it (or null at the top of the file), the gaps, and the gap after the last hunk. */
  function buildHunks(ops, context, expanded) {
    var N = ops.length;
    var visible = new Array(N);
    var gapOf = new Array(N);
    var gaps = [];
    var i = 0;
    while (i < N) {
      if (ops[i].t !== " ") {
        visible[i] = true;
        gapOf[i] = null;
        i++;
        continue;
      }
      var j = i;
      while (j < N && ops[j].t === " ") j++;
      var head = i === 0 ? 0 : context;
      var tail = j === N ? 0 : context;
      var hs = Math.min(j, i + head);
      var he = Math.max(hs, j - tail);
      var gap = null;
      if (he - hs >= 2) {
        gap = gaps.length;
        gaps.push({ index: gap, start: hs, end: he, count: he - hs });
      }
      for (var k = i; k < j; k++) {
        var hidden = gap !== null && k >= hs && k < he;
        gapOf[k] = hidden ? gap : null;
        visible[k] = !hidden || expanded.has(gap);
      }
      i = j;
    }
    var hunks = [];
    var oldSeen = 0;
    var newSeen = 0;
    var hunk = null;
    for (var x = 0; x < N; x++) {
      var op = ops[x];
      if (visible[x]) {
        if (!hunk) {
          hunk = { gapBefore: x > 0 ? gapOf[x - 1] : null, ops: [], oldBefore: oldSeen, newBefore: newSeen };
          hunks.push(hunk);
        }
        hunk.ops.push(op);
      } else {
        hunk = null;
      }
      if (op.t !== "+") oldSeen++;
      if (op.t !== "-") newSeen++;
    }
    hunks.forEach(function (h) {
      var oc = 0;
      var nc = 0;
      h.ops.forEach(function (op) {
        if (op.t !== "+") oc++;
        if (op.t !== "-") nc++;
      });
      h.oldStart = oc ? h.oldBefore + 1 : h.oldBefore;
      h.newStart = nc ? h.newBefore + 1 : h.newBefore;
      h.header = "@@ -" + h.oldStart + "," + oc + " +" + h.newStart + "," + nc + " @@";
    });
    var trailing = N && !visible[N - 1] ? gapOf[N - 1] : null;
    return { hunks: hunks, gaps: gaps, trailingGap: trailing };
  }

  function toDiffFile(fd, model) {
    var ext = fd.path.indexOf(".") >= 0 ? fd.path.split(".").pop() : "";
    return {
      oldName: fd.path,
      newName: fd.path,
      language: ext,
      isCombined: false,
      isGitDiff: true,
      isNew: fd.status === "added",
      isDeleted: fd.status === "removed",
      addedLines: fd.added,
      deletedLines: fd.removed,
      blocks: model.hunks.map(function (h) {
        return {
          oldStartLine: h.oldStart,
          newStartLine: h.newStart,
          header: h.header,
          lines: h.ops.map(function (op) {
            if (op.t === "+") return { type: "insert", content: "+" + op.s, oldNumber: undefined, newNumber: op.n };
            if (op.t === "-") return { type: "delete", content: "-" + op.s, oldNumber: op.o, newNumber: undefined };
            return { type: "context", content: " " + op.s, oldNumber: op.o, newNumber: op.n };
          })
        };
      })
    };
  }

  // ---- state in the URL hash -----------------------------------------------------------------

  function enc(v) {
    return encodeURIComponent(v).replace(/%2F/g, "/");
  }

  function readHash() {
    var p = new URLSearchParams(window.location.hash.replace(/^#/, ""));
    return {
      from: p.get("from"),
      to: p.get("to"),
      file: p.get("file"),
      view: p.get("view"),
      context: p.get("context"),
      expand: p.get("expand")
    };
  }

  function defaultFile(list) {
    for (var i = 0; i < list.changed.length; i++) {
      if (list.changed[i].path === "llm.py") return "llm.py";
    }
    if (list.changed.length) return list.changed[0].path;
    return list.unchanged.length ? list.unchanged[0] : null;
  }

  /* A complete, valid state from whatever the URL says; the default is each version against
   * the one before it. */
  function normalize(raw) {
    var toIdx = NAMES.indexOf(raw.to);
    var fromIdx = NAMES.indexOf(raw.from);
    if (toIdx < 0) toIdx = fromIdx >= 0 ? Math.min(fromIdx + 1, NAMES.length - 1) : Math.min(1, NAMES.length - 1);
    if (fromIdx < 0) fromIdx = Math.max(toIdx - 1, 0);
    var s = {
      from: NAMES[fromIdx],
      to: NAMES[toIdx],
      view: VIEWS.indexOf(raw.view) >= 0 ? raw.view : "split",
      context: CONTEXTS.indexOf(raw.context) >= 0 ? raw.context : "3"
    };
    var list = fileList(s.from, s.to);
    var known = list.unchanged.concat(list.changed.map(function (f) { return f.path; }));
    s.file = raw.file && known.indexOf(raw.file) >= 0 ? raw.file : defaultFile(list);
    var seen = {};
    s.expand = String(raw.expand || "")
      .split(",")
      .filter(function (g) { return /^\d+$/.test(g) && !seen[g] && (seen[g] = true); })
      .map(Number)
      .sort(function (a, b) { return a - b; });
    if (s.context === "all") s.expand = [];
    return s;
  }

  function hashOf(s) {
    var parts = [["from", s.from], ["to", s.to], ["file", s.file], ["view", s.view], ["context", s.context]];
    if (s.expand && s.expand.length) parts.push(["expand", s.expand.join(",")]);
    return "#" + parts
      .filter(function (p) { return p[1] !== null && p[1] !== undefined && p[1] !== ""; })
      .map(function (p) { return p[0] + "=" + enc(p[1]); })
      .join("&");
  }

  function go(patch) {
    var next = Object.assign({}, current, patch);
    var hash = hashOf(next);
    if (hash !== window.location.hash) window.location.hash = hash; // fires hashchange -> render
  }

  // ---- rendering -----------------------------------------------------------------------------

  function fillSelects() {
    [els.from, els.to].forEach(function (sel) {
      sel.innerHTML = DATA.versions
        .map(function (v) {
          return '<option value="' + esc(v.name) + '" title="' + esc(v.summary) + '">' + esc(v.name) + "</option>";
        })
        .join("");
    });
    els.context.innerHTML = CONTEXTS.map(function (c) {
      var label = c === "all" ? T.context_all : fmt(T.context_lines, { n: c });
      return '<option value="' + c + '">' + esc(label) + "</option>";
    }).join("");
  }

  function renderControls(s) {
    els.from.value = s.from;
    els.to.value = s.to;
    els.context.value = s.context;
    els.expandAll.disabled = s.context === "all";
    Array.prototype.forEach.call(els.views, function (b) {
      b.setAttribute("aria-pressed", b.getAttribute("data-view") === s.view ? "true" : "false");
    });
  }

  function statusBadge(status) {
    var letter = { added: "A", removed: "D", modified: "M" }[status];
    return '<span class="status status-' + status + '" title="' + esc(T[status]) + '">' + letter + "</span>";
  }

  function renderFiles(s) {
    var list = fileList(s.from, s.to);
    var added = 0;
    var removed = 0;
    list.changed.forEach(function (f) { added += f.added; removed += f.removed; });
    var n = list.changed.length;
    var html = '<p class="files-summary">' + esc(n === 1 ? T.file_changed : fmt(T.files_changed, { n: n })) +
      ' <span class="add">+' + added + '</span> <span class="del">−' + removed + "</span></p>";
    html += '<ul class="file-list">';
    list.changed.forEach(function (f) {
      var cur = f.path === s.file;
      html += '<li><a class="file-item' + (cur ? " selected" : "") + '" data-path="' + esc(f.path) + '"' +
        (cur ? ' aria-current="true"' : "") + ' href="' + esc(hashOf(Object.assign({}, s, { file: f.path, expand: [] }))) + '">' +
        statusBadge(f.status) + '<span class="path">' + esc(f.path) + "</span>" +
        '<span class="counts"><span class="add">+' + f.added + '</span> <span class="del">−' + f.removed + "</span></span></a></li>";
    });
    html += "</ul>";
    if (list.unchanged.length) {
      var open = list.unchanged.indexOf(s.file) >= 0 ? " open" : "";
      html += '<details class="unchanged-files"' + open + "><summary>" + esc(fmt(T.unchanged_files, { n: list.unchanged.length })) +
        '</summary><ul class="file-list">';
      list.unchanged.forEach(function (p) {
        var cur = p === s.file;
        html += '<li><a class="file-item unchanged' + (cur ? " selected" : "") + '" data-path="' + esc(p) + '"' +
          (cur ? ' aria-current="true"' : "") + ' href="' + esc(hashOf(Object.assign({}, s, { file: p, expand: [] }))) + '">' +
          '<span class="path">' + esc(p) + "</span></a></li>";
      });
      html += "</ul></details>";
    }
    els.files.innerHTML = html;

    var to = DATA.versions[NAMES.indexOf(s.to)];
    els.summary.innerHTML = '<span class="pair">' + esc(fmt(T.summary, { from: s.from, to: s.to })) + "</span>" +
      ' <a class="version-link" href="torchlet/' + encodeURIComponent(s.to) + '.html">' + esc(fmt(T.version_page, { name: s.to })) + "</a>" +
      (to && to.summary ? '<span class="to-summary" lang="en">' + esc(to.summary) + "</span>" : "");
  }

  function gapLabel(gap) {
    return gap.count === 1 ? T.show_line : fmt(T.show_lines, { n: gap.count });
  }

  function fillGapRow(row, gap, header) {
    row.classList.add("gap-row");
    row.setAttribute("data-gap", gap.index);
    var line = row.querySelector("td.d2h-info:not([class*=linenumber]) div") || row.querySelector("td.d2h-info div");
    if (!line) return;
    line.innerHTML = '<button type="button" class="expand-gap" data-gap="' + gap.index + '">↕ ' + esc(gapLabel(gap)) + "</button>" +
      (header ? ' <span class="hunk-header">' + esc(header) + "</span>" : "");
  }

  function decorateGaps(model, split) {
    var bodies = els.diff.querySelectorAll("tbody.d2h-diff-tbody");
    Array.prototype.forEach.call(bodies, function (tbody) {
      var infoRows = Array.prototype.filter.call(tbody.rows, function (r) { return r.querySelector("td.d2h-info"); });
      model.hunks.forEach(function (h, k) {
        var row = infoRows[k];
        if (!row) return;
        if (h.gapBefore === null) row.classList.add("hunk-first");
        else fillGapRow(row, model.gaps[h.gapBefore], h.header);
      });
      if (model.trailingGap !== null) {
        var row = document.createElement("tr");
        var lineClass = split ? "d2h-code-side-line" : "d2h-code-line";
        var numClass = split ? "d2h-code-side-linenumber" : "d2h-code-linenumber";
        row.innerHTML = '<td class="' + numClass + ' d2h-info"></td><td class="d2h-info"><div class="' + lineClass + '"></div></td>';
        tbody.appendChild(row);
        fillGapRow(row, model.gaps[model.trailingGap], "");
      }
    });
  }

  function renderDiff(s) {
    if (!s.file) {
      els.diff.innerHTML = '<p class="notice">' + esc(T.no_changes) + "</p>";
      return;
    }
    var fd = fileDiff(s.from, s.to, s.file);
    if (fd.same) {
      els.diff.innerHTML = '<p class="notice">' + esc(T.file_unchanged) + "</p>";
      return;
    }
    var context = s.context === "all" ? Infinity : parseInt(s.context, 10);
    var model = buildHunks(fd.ops, context, new Set(s.expand));
    var split = s.view === "split";
    var ui = new window.Diff2HtmlUI(els.diff, [toDiffFile(fd, model)], {
      outputFormat: split ? "side-by-side" : "line-by-line",
      drawFileList: false,
      matching: "lines",
      highlight: true,
      fileListToggle: false,
      fileContentToggle: false,
      stickyFileHeaders: false,
      synchronisedScroll: true,
      colorScheme: "light"
    }, window.hljs);
    ui.draw();
    decorateGaps(model, split);
    els.diff.setAttribute("data-gaps", String(model.gaps.length));
  }

  function render() {
    if (NAMES.length < 2) {
      app.setAttribute("data-state", "empty");
      els.diff.innerHTML = '<p class="notice">' + esc(fmt(T.need_two, { n: NAMES.length })) + "</p>";
      Array.prototype.forEach.call(app.querySelectorAll("select, button"), function (c) { c.disabled = true; });
      return;
    }
    var s = normalize(readHash());
    var hash = hashOf(s);
    if (hash !== window.location.hash) window.history.replaceState(null, "", hash);
    current = s;
    if (window.updateLangSwitch) window.updateLangSwitch();
    var y = window.scrollY;
    renderControls(s);
    renderFiles(s);
    renderDiff(s);
    window.scrollTo(window.scrollX, y);
    app.setAttribute("data-state", "ready");
    app.setAttribute("data-from", s.from);
    app.setAttribute("data-to", s.to);
    app.setAttribute("data-file", s.file || "");
    app.setAttribute("data-view", s.view);
    app.setAttribute("data-hash", hash); // what is on screen now (tests wait for it, not for the URL)
  }

  // ---- events --------------------------------------------------------------------------------

  /* The open file stays open across a change of versions if it differs there too. */
  function keptFile(from, to) {
    return fileList(from, to).changed.some(function (f) { return f.path === current.file; }) ? current.file : null;
  }
  els.from.addEventListener("change", function () {
    go({ from: els.from.value, file: keptFile(els.from.value, current.to), expand: [] });
  });
  els.to.addEventListener("change", function () {
    go({ to: els.to.value, file: keptFile(current.from, els.to.value), expand: [] });
  });
  els.swap.addEventListener("click", function () {
    go({ from: current.to, to: current.from, expand: [] });
  });
  els.context.addEventListener("change", function () {
    go({ context: els.context.value, expand: [] });
  });
  els.expandAll.addEventListener("click", function () {
    go({ context: "all", expand: [] });
  });
  Array.prototype.forEach.call(els.views, function (b) {
    b.addEventListener("click", function () { go({ view: b.getAttribute("data-view") }); });
  });
  els.diff.addEventListener("click", function (e) {
    var button = e.target.closest("button.expand-gap");
    if (!button) return;
    var g = Number(button.getAttribute("data-gap"));
    go({ expand: current.expand.concat([g]).sort(function (a, b) { return a - b; }) });
  });
  window.addEventListener("hashchange", render);

  fillSelects();
  render();
})();
