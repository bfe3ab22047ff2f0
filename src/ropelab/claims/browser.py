"""Open an HTML report in headless Chromium and list what a reader would see broken.

`check_in_browser` renders a copy of the page with a small script injected that, once the page has
loaded, checks it and writes the problems as JSON into an element, which is read back from
Chromium's ``--dump-dom``. The checks: the page loads; it fetches nothing from outside itself; every
image decodes; every ``#anchor`` link has its target; the first table is the verdict table
(``id="verdicts"``) with one row, linked to its section, per claim section (``id="claim-..."``); no
element runs more than `SLACK_PX` past the right edge of a `WIDTH_PX`-wide window. When asked for, a
screenshot shows the top `HEIGHT_PX` of the page in that window. No Python package is needed, only Chromium.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

CHROMIUMS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# without a fresh profile and with the network features on, headless Chromium can hang on lookups
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")
WIDTH_PX, HEIGHT_PX, SLACK_PX = 1280, 2000, 40
TIMEOUT_S = 60
RESULT_ID = "ropelab-browser-check"

CHECKS_JS = """
addEventListener("load", () => {
  const problems = [];
  const outside = [...document.querySelectorAll("img[src], script[src], iframe[src], source[src], link[rel~=stylesheet]")]
    .map(e => e.getAttribute("src") || e.getAttribute("href")).filter(url => !url.startsWith("data:"));
  outside.forEach(url => problems.push(`loads a resource from outside the page: ${url.slice(0, 80)}`));
  document.querySelectorAll("img").forEach((img, i) => {
    if (!img.complete || img.naturalWidth === 0) problems.push(`image ${i + 1} (${img.alt || "no alt"}) did not decode`);
  });
  document.querySelectorAll('a[href^="#"]').forEach(a => {
    const href = a.getAttribute("href");
    if (!document.getElementById(decodeURIComponent(href.slice(1)))) problems.push(`link ${href} has no target`);
  });
  const claims = document.querySelectorAll('[id^="claim-"]').length;
  const table = document.querySelector("table");
  if (!table || table.id !== "verdicts") problems.push("the first table is not the verdict table (id=verdicts)");
  else {
    const rows = table.querySelectorAll("tbody tr");
    if (claims === 0 || rows.length !== claims) problems.push(`the verdict table has ${rows.length} rows for ${claims} claim sections`);
    rows.forEach((row, i) => { if (!row.querySelector('a[href^="#claim-"]')) problems.push(`verdict row ${i + 1} links to no claim`); });
  }
  const width = document.documentElement.clientWidth;
  const wide = [...document.body.querySelectorAll("*")].filter(e => e.getBoundingClientRect().right > width + SLACK);
  wide.slice(0, 3).forEach(e => problems.push(
    `<${e.tagName.toLowerCase()}${e.id ? "#" + e.id : ""}> ends ${Math.round(e.getBoundingClientRect().right - width)} px past the ${width} px window`));
  document.getElementById("RESULT_ID").textContent = JSON.stringify(problems);
});
""".replace("SLACK", str(SLACK_PX)).replace("RESULT_ID", RESULT_ID)


def find_chromium() -> Optional[str]:
    """The path of a Chromium (or Chrome) executable on PATH, or None."""
    return next((path for path in map(shutil.which, CHROMIUMS) if path), None)


def _instrumented(page: str) -> str:
    probe = f'<pre id="{RESULT_ID}" hidden></pre><script>{CHECKS_JS}</script>'
    at = page.lower().rfind("</body>")
    return page[:at] + probe + page[at:] if at >= 0 else page + probe


def _chromium(chromium: str, work: Path, *args: str) -> subprocess.CompletedProcess:
    """Run Chromium once with a fresh profile under `work`; raises subprocess.TimeoutExpired."""
    profile = Path(tempfile.mkdtemp(prefix="profile-", dir=work))
    command = [chromium, *FLAGS, f"--user-data-dir={profile}", f"--window-size={WIDTH_PX},{HEIGHT_PX}",
               "--virtual-time-budget=5000", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)


def _failed(what: str, result: subprocess.CompletedProcess) -> Optional[str]:
    if result.returncode == 0:
        return None
    last = (result.stderr.strip().splitlines() or ["no message"])[-1]
    return f"chromium {what} exited with status {result.returncode}: {last}"


def _page_problems(dom: str) -> list[str]:
    found = re.search(rf'<pre id="{RESULT_ID}"[^>]*>(.*?)</pre>', dom, re.DOTALL)
    if not found or not found.group(1).strip():
        return ["the page did not finish loading (its load event never ran the checks)"]
    return json.loads(html.unescape(found.group(1)))


def check_in_browser(html_path: str | Path, screenshot: str | Path | None = None) -> list[str]:
    """The problems headless Chromium finds on the page at `html_path` (none: it renders whole);
    with `screenshot`, also a PNG of the page there. A missing Chromium or page is a problem too."""
    chromium = find_chromium()
    if chromium is None:
        return [f"no Chromium found on PATH (tried {', '.join(CHROMIUMS)}); on Debian: apt-get install chromium"]
    source = Path(html_path)
    if not source.is_file():
        return [f"{source}: no such file"]
    with tempfile.TemporaryDirectory(prefix="browser-check-") as tmp:
        work = Path(tmp)
        page = work / source.name  # alone in a folder: anything the page needs beside it is missing
        page.write_text(_instrumented(source.read_text(encoding="utf-8")), encoding="utf-8")
        try:
            result = _chromium(chromium, work, "--dump-dom", page.as_uri())
            failed = _failed("--dump-dom", result)
            problems = [failed] if failed else _page_problems(result.stdout)
            if screenshot is not None:
                problems += _screenshot(chromium, work, page, Path(screenshot))
        except subprocess.TimeoutExpired:
            problems = [f"chromium did not finish within {TIMEOUT_S} s"]
    return problems


def _screenshot(chromium: str, work: Path, page: Path, out: Path) -> list[str]:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    result = _chromium(chromium, work, f"--screenshot={out.resolve()}", page.as_uri())
    failed = _failed("--screenshot", result)
    if failed:
        return [failed]
    return [] if out.is_file() and out.stat().st_size > 0 else [f"no screenshot was written to {out}"]
