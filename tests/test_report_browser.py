"""The HTML report in a real browser: Debian's Chromium, headless, through playwright.

Reports of the seed bug (wrong segments), its fix (a match) and a subset bug recorded here (zeros on
decode rows) are loaded from file://; the page must run without a script error or a console error,
and show what a person looks for: the Fix box in the first screen, the verdict with its root cause,
the findings grouped by cause, the heatmap of the cosine the decisions used, a per-position chart for
each wrong segment and subset, and each matched pair's threshold line. A full-page screenshot of each is kept (tmp_path, and /tmp/tracediff-html-*.png to
look at).

Chromium comes from the system packages (requirements/browser.sh); playwright never downloads one.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
from subset_traces import record_subset_traces

from tracediff.compare import compare_stores
from tracediff.demo import default_samples_dir
from tracediff.report import write_report

pytestmark = pytest.mark.slow

SAMPLES = default_samples_dir()
CHROMIUM = shutil.which("chromium")
#: Where the screenshots are also written, for a person to look at.
SCREENSHOTS = Path("/tmp")


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("chromium is not on PATH: install Debian's package with requirements/browser.sh")
    from playwright.sync_api import sync_playwright  # noqa: PLC0415

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory):
    """name -> (Report, html path) for the three cases."""
    root = tmp_path_factory.mktemp("browser")
    traces = record_subset_traces(root / "traces")
    cases = {
        "broken": (SAMPLES / "train.zarr", SAMPLES / "server_broken.zarr"),
        "fixed": (SAMPLES / "train.zarr", SAMPLES / "server_fixed.zarr"),
        "subset": (traces["ref"], traces["decode_zeros"]),
    }
    out = {}
    for name, (ref, cand) in cases.items():
        report = compare_stores(ref, cand)
        path = root / f"{name}.html"
        write_report(report, html_path=path)
        out[name] = (report, path)
    return out


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _open(browser, path: Path):
    """The page loaded from file://, with every page error and console error it raised."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.goto(path.resolve().as_uri(), wait_until="load")
    return page, errors


def _visible(page, selector: str, count: int | None = None) -> list:
    found = page.locator(selector)
    n = found.count()
    assert n >= 1 if count is None else n == count, f"{selector}: {n} found"
    items = [found.nth(k) for k in range(n)]
    for item in items:
        item.scroll_into_view_if_needed()
        assert item.is_visible(), selector
        box = item.bounding_box()
        assert box and box["width"] > 20 and box["height"] > 8, (selector, box)
    return items


@pytest.mark.parametrize("name", ["broken", "fixed", "subset"])
def test_report_renders_in_chromium_without_errors_and_shows_what_matters(browser, reports, name, tmp_path):
    report, path = reports[name]
    page, errors = _open(browser, path)
    try:
        # The fix is the first thing a person sees: its box lies whole in the first screen, unscrolled.
        fix = page.locator("section.box.fix")
        assert (report.fix is not None) == (name == "broken")
        assert fix.count() == (1 if report.fix else 0)
        if report.fix:
            box = fix.bounding_box()
            assert box and box["y"] >= 0 and box["y"] + box["height"] <= 900, box
            shown = fix.inner_text()
            assert f"{report.fix['field']} = {report.fix['value']}" in shown
            assert all(c in shown for step in report.fix["steps"] for c in step["commands"])
        if name == "broken":
            cause = page.locator("header.verdict p.cause").inner_text()
            assert cause == "1 root cause: the candidate's segments are shifted by one slot; 2 consequences."
        verdict = _visible(page, "header.verdict", 1)[0]
        assert f"tracediff compare: {report.verdict.upper()}" in verdict.inner_text()
        _visible(page, "#findings")
        if any(f.severity == "error" for f in report.findings):
            _visible(page, "#findings li.error")
        # Each root cause's card holds what follows from it; no error card is shown twice.
        cards = page.locator("#findings li.cause")
        assert cards.count() == len(report.causes())
        for k, cause in enumerate(report.causes()):
            nested = cards.nth(k).locator("ul.consequences > li").count()
            assert nested == len(cause.consequences) + len(cause.config)
        assert page.locator("li.error").count() == sum(f.severity == "error" for f in report.findings)
        label = _visible(page, ".heatmap-label", 1)[0]
        assert label.inner_text().startswith("Standardised cosine (what segment matching decides on")
        _visible(page, ".chart.heatmap svg", 1)
        cells = page.locator(".chart.heatmap svg rect > title").evaluate_all("ts => ts.map(t => t.textContent)")
        assert len(cells) == len(report.matrix) * len(report.matrix[0])
        assert all("(decides), raw cosine" in t for t in cells)
        # Each wrong segment and each subset has its per-position charts, with points drawn, and the
        # finding links to them.
        wrong = [f for f in report.findings if f.kind in ("segment_missing", "segment_extra", "segment_subset")]
        assert bool(wrong) == (name != "fixed")
        pairs = {(m.candidate, m.reference) for m in report.metrics}
        wrong += [f for f in report.findings if f.kind in ("segment_value", "segment_scale", "precision")
                  and (f.evidence.get("candidate_segment"), f.evidence.get("reference_segment")) in pairs]
        assert page.locator("div.profile").count() == len({(p.kind, p.candidate, p.reference)
                                                              for p in report.position_profiles})
        for link in page.locator("#findings a.chart-link").all():
            anchor = link.get_attribute("href")
            charts = _visible(page, f"{anchor} .chart svg")
            assert len(charts) == 2
            for chart in charts:
                assert chart.locator("circle").count() >= 5
        assert page.locator("#findings a.chart-link").count() == len(wrong)
        # Every matched pair's error chart draws the numerics budget its findings use.
        lines = _visible(page, "#metrics g.threshold.budget")
        assert len(lines) == len(report.metrics)
        values = [float(v) for v in page.locator("#metrics g.threshold.budget").evaluate_all(
            "gs => gs.map(g => g.dataset.value)")]
        assert values == pytest.approx([m.numerics_budget for m in report.metrics])
        # Config paths stay on one line.
        for cell in page.locator("table.config td.path code").all():
            assert cell.evaluate("c => getComputedStyle(c).whiteSpace") == "nowrap"
            box = cell.bounding_box()
            assert box and box["height"] < 24, cell.inner_text()
        data = page.screenshot(full_page=True)
    finally:
        page.close()
    assert errors == []
    width, height = _png_size(data)
    assert width >= 1000 and height >= 1500 and len(data) > 50_000
    (tmp_path / f"{name}.png").write_bytes(data)
    (SCREENSHOTS / f"tracediff-html-{name}.png").write_bytes(data)
