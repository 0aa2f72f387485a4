"""Browser tier: the report rendered by headless Chromium (Debian's ``chromium``; ``.ci/run`` installs
it). The screenshot must not be blank and the DOM after loading must hold every chart. Skipped without Chromium."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from reference import random_sequences, write_sequences

from grpo_cli.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium on PATH: the browser tier needs Debian's `chromium` (apt-get install chromium; .ci/run does)",
)]

CHART_IDS = ("fig-trend-clip", "fig-trend-kl", "fig-trend-is-ess", "fig-trend-is-chi2", "fig-trend-entropy",
             "fig-trend-staleness", "fig-trend-loss", "fig-hist-ratio", "fig-hist-abs-diff", "fig-heat-staleness",
             "fig-prox-lag")


def chromium(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # As root Chromium refuses to start without --no-sandbox; its stderr is dbus/launcher noise.
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--hide-scrollbars", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    folder = tmp_path_factory.mktemp("browser")
    path = folder / "rollouts.parquet"
    write_sequences(str(path), random_sequences(60, seed=8, with_prox=True, spread=0.5), row_group_size=16)
    out = folder / "report.html"
    assert main(["report", str(path), "-o", str(out), "-q"]) == 0
    return out


def test_screenshot_is_not_blank(page, tmp_path):
    from matplotlib.image import imread

    shot = tmp_path / "shot.png"
    proc = chromium("--window-size=1200,2400", f"--screenshot={shot}", page.as_uri())
    assert shot.exists(), proc.stderr[-2000:]
    pixels = imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (2400, 1200)
    colours = np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50  # text, lines, bars and heat-map shades, not one flat colour
    ink = (pixels.min(axis=2) < 0.6).mean()  # clearly non-white pixels
    assert 0.01 < ink < 0.6
    # The first screenful carries content from top to bottom (the header and the first charts, not an empty page).
    rows_with_ink = (pixels.min(axis=2) < 0.6).any(axis=1)
    assert rows_with_ink[:300].any() and rows_with_ink[1200:2400].any()


def test_dom_holds_every_chart(page):
    proc = chromium("--dump-dom", page.as_uri())
    dom = proc.stdout
    assert "<h1>grpo-cli report</h1>" in dom, proc.stderr[-2000:]
    for chart in CHART_IDS:
        assert f'id="{chart}-figure"' in dom and f'<svg id="{chart}"' in dom, chart
    assert dom.count("<svg ") == len(CHART_IDS)
    assert dom.count("<text") > 100  # axis labels, ticks, legends and heat-map values as real text
    assert 'id="report-data"' in dom and "Not shown" not in dom
