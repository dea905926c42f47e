"""``opalctl report LOCK`` and ``opalctl show RUN --html``: one offline page, opened in a real headless Chromium.

The page must load with no console message of error level and no network request but its own file, look like
something (a screenshot that is not blank), and show the numbers ``opalctl compare --json`` gives.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from html import escape
from html.parser import HTMLParser

import pytest

from tests.support.cli import call_cli


@pytest.fixture(scope="module")
def page(grid, tmp_path_factory):
    from opalctl.report.grid_page import write_grid_page

    return write_grid_page(grid["lock"], runs_dir=grid["runs"], out=tmp_path_factory.mktemp("page"))


class Cells(HTMLParser):
    """Every element's ``data-*`` attributes with its text."""

    def __init__(self):
        super().__init__()
        self.cells: list[dict[str, str]] = []
        self._open: dict[str, str] | None = None

    def handle_starttag(self, tag, attrs):
        data = {k[5:]: v for k, v in attrs if k.startswith("data-")}
        if "value" in data or "field" in data:
            self._open = {**data, "text": ""}
            self.cells.append(self._open)

    def handle_data(self, data):
        if self._open is not None:
            self._open["text"] += data

    def handle_endtag(self, tag):
        self._open = None


def _not_blank(png: bytes) -> tuple[int, float]:
    """(distinct colours, share of pixels that are not the background) of a screenshot."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3)
    colours, counts = np.unique(pixels, axis=0, return_counts=True)
    return len(colours), 1.0 - counts.max() / len(pixels)


def test_the_checks_in_chromium_catch_a_console_error_and_a_request(browser, tmp_path):
    """The harness itself: a page that logs an error and asks for an image is caught on both counts."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><img src="http://127.0.0.1:9/x.png">'
                   '<script>console.error("caught")</script></body></html>')
    loaded = browser.load(bad.as_uri())
    assert any(m["type"] == "error" for m in loaded["console"])
    assert "http://127.0.0.1:9/x.png" in loaded["requests"]


def test_the_report_page_loads_offline_in_chromium_and_is_not_blank(browser, page):
    loaded = browser.load(page.as_uri())
    assert loaded["errors"] == [] and [m for m in loaded["console"] if m["type"] in ("error", "warning")] == []
    assert loaded["requests"] == [page.as_uri()], "no request but the page itself"
    colours, covered = _not_blank(loaded["png"])
    assert colours > 50 and covered > 0.03, (colours, covered)
    assert loaded["dom"].count("<svg") >= 4, "the loss, stages, forest and timeline figures"


def test_the_numbers_on_the_page_equal_compare_json(browser, page, grid):
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", grid["runs"], "--json")
    assert code == 0, err
    rows = {row["arm"]: row for row in json.loads(out)["arms"]}
    dom = browser.load(page.as_uri())["dom"]
    parser = Cells()
    parser.feed(dom)
    metric_cells = [c for c in parser.cells if c.get("metric") and c.get("field") in ("mean", "std")]
    paired_cells = [c for c in parser.cells if c.get("metric") and c.get("field") not in ("mean", "std")]
    assert len(metric_cells) == 2 * len(rows) * len(json.loads(out)["metrics"])
    from opalctl.compare.columns import REPORT

    numbers = [key for _, key in REPORT if key != "wins"]  # w/t/l is one cell of three counts
    assert len(paired_cells) == len(numbers) * sum(len(r["paired"]) for r in rows.values())
    for cell in metric_cells:
        expected = rows[cell["arm"]]["metrics"][cell["metric"]][cell["field"]]
        assert float(cell["value"]) == expected
        assert float(cell["text"]) == pytest.approx(expected, rel=5e-4, abs=1e-12), cell
    for cell in paired_cells:
        expected = rows[cell["arm"]]["paired"][cell["metric"]][cell["field"]]
        if expected is None:
            figure = rows[cell["arm"]]["paired"][cell["metric"]]
            infinite = cell["field"] == "d_z" and figure["sd_difference"] == 0 and figure["mean_difference"] != 0
            assert "value" not in cell and cell["text"] in (("+inf", "-inf") if infinite else ("-",))
        else:
            assert float(cell["value"]) == expected and float(cell["text"]) == pytest.approx(expected, rel=5e-4)
    for row in rows.values():
        for figure in row["paired"].values():
            assert escape(figure["verdict"], quote=False) in dom, "the DOM escapes <, > and & in text"
    legend = re.search(r'<dl class="legend">(.*?)</dl>', dom).group(1)
    for header, _ in REPORT:
        assert f"<dt>{escape(header, quote=False)}</dt><dd>" in legend, f"the legend defines {header}"


def test_the_page_holds_what_a_reader_needs_and_nothing_that_fetches(page, grid):
    text = page.read_text(encoding="utf-8")
    assert "Content-Security-Policy" in text and "default-src 'none'" in text
    assert not re.search(r"<(script|link|iframe|object|embed)\b", text)
    assert not re.search(r"\b(src|href)\s*=\s*[\"'](?!#|data:)", text), "nothing names another file"
    for anchor in ("lock", "verdicts", "tables", "figures", "decisions", "limitations"):
        assert f'id="{anchor}"' in text
    assert "verifies: all" in text and grid["lock"].read_bytes() and "<code>" in text
    events = [json.loads(line) for line in
              (next(grid["runs"].glob("*/agent/seed-1")) / "training" / "opal" / "events.jsonl").read_text().splitlines()]
    applied = [e for e in events if e.get("kind") == "applied"]
    kept = [e for e in events if e.get("kind") == "kept"]
    assert kept and kept[0]["summary"].replace("'", "&#x27;") in text
    if applied:
        assert "<summary>diff</summary>" in text and "+++ decision 0" in text
    report = json.loads((next(grid["runs"].glob("*/adamw/seed-1")) / "report.json").read_text())
    for limitation in report["limitations"]:
        if "a single seed says nothing about spread" in limitation:  # each run's, said once for the page
            assert limitation.replace("'", "&#x27;") not in text
            assert text.count("a single seed says nothing about spread") == 1
        else:
            assert limitation.replace("'", "&#x27;") in text


def test_the_page_says_when_the_lock_no_longer_verifies(grid, tmp_path):
    from opalctl.report.grid_page import write_grid_page

    project = tmp_path / "project"
    shutil.copytree(grid["project"], project)
    data = project / "data" / "digits" / "selection.npz"
    data.write_bytes(data.read_bytes() + b"\0")
    path = write_grid_page(project / grid["lock"].name, runs_dir=grid["runs"], out=tmp_path / "page")
    text = path.read_text(encoding="utf-8")
    assert "does not verify" in text and "selection.npz" in text


def test_report_command_writes_the_page_and_prints_its_path(grid, tmp_path):
    code, out, err = call_cli("report", grid["lock"], "--runs-dir", grid["runs"], "--out", tmp_path / "out")
    assert code == 0, err
    assert out == f"{tmp_path / 'out' / 'report.html'}\n" and (tmp_path / "out" / "report.html").is_file()
    code, out, err = call_cli("report", grid["lock"], "--runs-dir", tmp_path / "none")
    assert code == 2 and out == "" and "there are no runs" in err


def test_show_html_writes_the_run_page_which_loads_offline(browser, grid, tmp_path):
    run_dir = next(grid["runs"].glob("*/agent/seed-1"))
    target = tmp_path / "run.html"
    code, out, err = call_cli("show", run_dir, "--html", target)
    assert code == 0, err and f"wrote {target}" in err
    assert out.startswith("agent seed 1 (finished)"), "the table is printed as well"
    loaded = browser.load(target.as_uri())
    assert loaded["errors"] == [] and loaded["requests"] == [target.as_uri()]
    assert _not_blank(loaded["png"])[1] > 0.03
    stages = [json.loads(p.read_text()) for p in sorted(run_dir.glob("stage-*.json"))]
    parser = Cells()
    parser.feed(loaded["dom"])
    for stage in stages:
        for reason in stage["decision"]["reasons"]:
            assert escape(reason, quote=False) in loaded["dom"]
        for metric, value in stage["metrics"].items():
            if not metric.endswith(".total"):
                [cell] = [c for c in parser.cells if c.get("metric") == metric and c.get("stage") == str(stage["stage"])]
                assert float(cell["value"]) == value


def test_without_matplotlib_the_report_says_what_to_install(grid, monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails as if not installed
    monkeypatch.delitem(sys.modules, "opalctl.report.figures", raising=False)
    monkeypatch.delattr("opalctl.report.figures", raising=False)  # the package's attribute, once imported
    code, out, err = call_cli("report", grid["lock"], "--runs-dir", grid["runs"], "--out", tmp_path)
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert "need matplotlib" in err and "pip install matplotlib" in err and not (tmp_path / "report.html").exists()
