"""The HTML report in a real browser: headless Chromium (Debian package ``chromium``) loads the page
from disk, every embedded plot decodes, and a full-page screenshot is saved for a human to look at.

The screenshot is kept in the test's tmp dir, and copied to ``$SPECTUNER_ARTIFACTS_DIR`` when set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image as mpimg

from tests.integration import report_factories as F
from tuner.report import write_report
from tuner.store import Store, upgrade

_FLAGS = (
    "--headless",
    "--no-sandbox",  # root in CI containers
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
# Injected into a copy of the page (the report itself has no script): once everything has loaded,
# write what the browser made of each image into the DOM, where --dump-dom shows it.
_PROBE = """<script>
window.addEventListener("load", () => {
  const imgs = Array.from(document.images).map(i => ({id: i.id, complete: i.complete,
    width: i.naturalWidth, height: i.naturalHeight}));
  const pre = document.createElement("pre"); pre.id = "probe"; pre.textContent = JSON.stringify(imgs);
  document.body.appendChild(pre);
});
</script>"""


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(
        "headless Chromium is needed for this test: run `make system-deps` "
        "(or `apt-get install -y chromium`)",
        pytrace=False,
    )


def _browser(args: list[str], profile: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(profile)}  # keep ~/.config/chromium and crash dumps out of $HOME
    return subprocess.run(
        [_chromium(), *_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'spectuner.db'}"
    upgrade(url)
    with Store(url) as store:
        F.populate(store)
        result = write_report(store, tmp_path / "report")
    assert len(result.images) == 5

    probe_page = tmp_path / "report" / "probe.html"
    probe_page.write_text(result.index_html.read_text().replace("</body>", _PROBE + "</body>"))
    dumped = _browser(["--virtual-time-budget=10000", "--dump-dom", probe_page.as_uri()], tmp_path / "profile")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    match = re.search(r'<pre id="probe">(.*?)</pre>', dumped.stdout, re.S)
    assert match, f"the probe did not run; page dump starts: {dumped.stdout[:500]!r}"
    images = json.loads(match.group(1).replace("&quot;", '"'))
    assert sorted(i["id"] for i in images) == sorted(f"fig-{s}" for s in result.images)
    for img in images:
        assert img["complete"] and img["width"] > 400 and img["height"] > 250, img

    shot = tmp_path / "report.png"
    taken = _browser(
        ["--window-size=1280,3600", f"--screenshot={shot}", result.index_html.as_uri()], tmp_path / "profile"
    )
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    pixels = np.asarray(mpimg.imread(shot))[..., :3]
    assert pixels.shape[:2] == (3600, 1280)
    ink = float((pixels.min(axis=2) < 0.9).mean())  # share of pixels that are not (near) white
    assert ink > 0.05, f"the screenshot is nearly blank ({ink:.1%} ink)"
    artifacts = os.environ.get("SPECTUNER_ARTIFACTS_DIR")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, Path(artifacts) / "report.png")
