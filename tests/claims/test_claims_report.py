"""The claims report on rigged findings: the verdict table opens each file, findings are escaped, the
JSON round-trips, figures are written beside the markdown, a failed render leaves the old report
intact; and headless Chromium finds the page whole (skipped without Chromium) and a broken page broken."""

from __future__ import annotations

import html
import json
import re
from html.parser import HTMLParser

import pytest

from ropelab.claims import report as claims_report
from ropelab.claims.browser import check_in_browser, find_chromium
from ropelab.claims.claim import Claim, Finding
from ropelab.claims.report import anchor, figure_path, write_claims_report
from ropelab.claims.verdict import DOES_NOT_HOLD, HOLDS, INCONCLUSIVE, Verdict, rule_text
from ropelab.config import ConfigError
from ropelab.study.plots import new_figure, png_bytes

needs_chromium = pytest.mark.skipif(find_chromium() is None, reason="Chromium is not installed (apt-get install chromium)")


def _png() -> bytes:
    fig = new_figure(4, 3)
    ax = fig.subplots()
    ax.plot([0.1, 0.25, 1.0], [3.1, 2.6, 2.5], "o-")
    ax.set_xlabel("rotary fraction")
    return png_bytes(fig)


def _claim(claim_id: str, statement: str) -> Claim:
    return Claim(claim_id, "partial-rope (000)", "Sec. 4, RQ1", statement, (f"{claim_id}-study",), judge=lambda folders: None)


def _entries() -> list[tuple[Claim, Finding]]:
    return [
        (_claim("rq1", "Partial RoPE at 10% matches full RoPE"),
         Finding("val loss 2.50 (10%) against 2.49 (100%)\nover 2 seeds", Verdict(HOLDS, "difference 0.01 against 2 x spread 0.02"),
                 figure=_png(), figure_caption="final validation loss by fraction")),
        (_claim("kd-beats-ce", "KD beats CE beyond the training length <b>& more</b>"),
         Finding("loss beyond 512: 3.1 (KD) | 3.0 (CE)", Verdict(DOES_NOT_HOLD, "CE lower by 0.1"),
                 table=(["run", "loss <beyond>"], [["kd", "3.1"], ["ce|x", "3.0 & <i>"]]), note="one seed pair <script>")),
        (_claim("rq6", "LAMBADA rises sharply at 25% " + "and more words " * 20),
         Finding("", Verdict(INCONCLUSIVE, "fraction 0.1: 1 seed(s), fewer than 2"), note="tiny scale")),
    ]


def _meta() -> dict:
    return {"machine": "2 CPU cores <cpu>", "command": "ropelab claims --out x",
            "studies": [{"name": "rq1-study", "runs": 4, "tokens": 1_200_000, "seconds": 12.34, "status": "done"}],
            "ropelab": "0.1.0", "seeds": [0, 1]}


class _Page(HTMLParser):
    """Ids, #links, tables (as lists of rows of cell text) and the order of tags of an HTML page."""

    def __init__(self):
        super().__init__()
        self.ids, self.links, self.tables, self.tags, self.images = set(), [], [], [], []
        self._cell = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href", "").startswith("#"):
            self.links.append(attrs["href"][1:])
        if tag == "img":
            self.images.append(attrs["src"])
        if tag == "table":
            self.tables.append((attrs.get("id"), []))
        if tag == "tr":
            self.tables[-1][1].append([])
        if tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][1][-1].append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


@pytest.fixture
def written(tmp_path):
    return tmp_path, write_claims_report(tmp_path, _entries(), _meta())


def test_html_opens_with_the_verdict_table_linked_to_each_claim(written):
    out, paths = written
    page = _Page()
    page.feed(paths["claims.html"].read_text())
    assert {"claims.html", "claims.md", "claims.json", "claims_files/rq1.png"} == set(paths)
    assert page.tags.index("table") < page.tags.index("section")
    table_id, rows = page.tables[0]
    assert table_id == "verdicts" and rows[0] == claims_report.VERDICT_HEADER
    assert [row[0] for row in rows[1:]] == ["rq1", "kd-beats-ce", "rq6"]
    assert [row[5] for row in rows[1:]] == [HOLDS, DOES_NOT_HOLD, INCONCLUSIVE]
    assert rows[1][6] == "difference 0.01 against 2 x spread 0.02"  # the verdict's reason
    assert rows[1][4] == "not stated / not stated"  # the regime, here and the seed's
    assert rows[3][3].endswith("…") and len(rows[3][3]) == claims_report.SHORT
    assert page.links[:3] == ["claim-rq1", "claim-kd-beats-ce", "claim-rq6"]
    assert set(page.links) <= page.ids
    assert len(page.images) == 1 and page.images[0].startswith("data:image/png;base64,")
    assert ["loss <beyond>"] == page.tables[2][1][0][1:]  # the studies table, then the finding's table
    assert page.tables[1][1][1] == ["rq1-study", "4", "1,200,000", "12.3", "done"]


def test_html_escapes_the_findings_and_states_rule_and_meta(written):
    text = written[1]["claims.html"].read_text()
    for raw in ("<b>& more</b>", "<script>", "<i>", "<cpu>"):
        assert raw not in text
    assert "&lt;b&gt;&amp; more&lt;/b&gt;" in text and "one seed pair &lt;script&gt;" in text
    assert "<script" not in text and "http" not in text  # no JavaScript, nothing fetched
    assert html.escape(rule_text()) in text and "ropelab claims --out x" in text and "<dt>seeds</dt><dd>[0, 1]</dd>" in text
    assert 'class="verdict holds"' in text and 'class="verdict fails"' in text and 'class="verdict open"' in text


def test_markdown_opens_with_the_verdict_table_and_links_the_figure(written):
    out, paths = written
    text = paths["claims.md"].read_text()
    first_table = next(line for line in text.splitlines() if line.startswith("|"))
    assert first_table == "| " + " | ".join(claims_report.VERDICT_HEADER) + " |"
    assert text.index("| [rq1](#claim-rq1) |") < text.index("## How a verdict is decided") < text.index("## rq1:")
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', text))
    assert set(re.findall(r"\]\(#([^)]+)\)", text)) <= anchors
    assert "| ce\\|x | 3.0 & <i> |" in text  # a pipe in a cell stays in its cell
    assert f"]({figure_path(_entries()[0][0])})" in text
    assert (out / "claims_files" / "rq1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "claims_files" / "rq6.png").exists()


def test_json_round_trips(written):
    data = json.loads(written[1]["claims.json"].read_text())
    assert data["meta"] == _meta() and data["rule"] == rule_text()
    first, second, third = data["claims"]
    assert first["id"] == "rq1" and first["verdict"] == HOLDS and first["figure"] == "claims_files/rq1.png"
    assert first["studies"] == ["rq1-study"] and first["measured"].endswith("over 2 seeds")
    assert second["table"] == {"header": ["run", "loss <beyond>"], "rows": [["kd", "3.1"], ["ce|x", "3.0 & <i>"]]}
    assert third["figure"] is None and third["table"] is None and third["verdict"] == INCONCLUSIVE


def test_a_failed_render_leaves_the_previous_report_intact(written, monkeypatch):
    out, paths = written
    before = {name: path.read_bytes() for name, path in paths.items()}

    def broken(entries, meta):
        raise RuntimeError("render failed")

    monkeypatch.setattr(claims_report, "render_html", broken)
    changed = [(_claim("rq1", "another statement"), Finding("other", Verdict(DOES_NOT_HOLD, "no")))]
    with pytest.raises(RuntimeError, match="render failed"):
        write_claims_report(out, changed, {})
    assert {name: path.read_bytes() for name, path in paths.items()} == before
    assert sorted(p.name for p in out.rglob("*")) == sorted(["claims.html", "claims.md", "claims.json", "claims_files", "rq1.png"])


@pytest.mark.parametrize("ids", [["rq1", "rq1"], ["has space"], ["../up"]])
def test_claim_ids_must_be_unique_and_safe_as_anchors_and_file_names(tmp_path, ids):
    entries = [(_claim(i, "s"), Finding("m", Verdict(HOLDS, "r"))) for i in ids]
    with pytest.raises(ConfigError, match="claim id"):
        write_claims_report(tmp_path, entries, {})
    assert not any(tmp_path.iterdir())


def test_anchor_names_the_claim_section():
    assert anchor(_claim("rq1", "s")) == "claim-rq1"


@needs_chromium
def test_chromium_renders_the_report_whole(written):
    out, paths = written
    shot = out / "shot.png"
    assert check_in_browser(paths["claims.html"], screenshot=shot) == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_chromium
def test_chromium_finds_a_broken_page_broken(written):
    out, paths = written
    text = paths["claims.html"].read_text()
    text = re.sub(r'src="data:image/png;base64,[^"]{20}', 'src="data:image/png;base64,AAAAAAAAAAAAAAAAAAAA', text, count=1)
    text = text.replace('id="claim-rq6"', 'id="gone"', 1)
    text = text.replace("<h1>", '<div style="width: 3000px">wide</div><h1>', 1)
    broken = out / "broken.html"
    broken.write_text(text)
    problems = check_in_browser(broken)
    assert any("image 1" in p and "did not decode" in p for p in problems), problems
    assert any("link #claim-rq6 has no target" in p for p in problems), problems
    assert any("verdict table has 3 rows for 2 claim sections" in p for p in problems), problems
    assert any("<div> ends" in p for p in problems), problems


def test_a_missing_page_or_chromium_is_a_problem(tmp_path, monkeypatch):
    if find_chromium() is not None:
        assert check_in_browser(tmp_path / "absent.html") == [f"{tmp_path / 'absent.html'}: no such file"]
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert check_in_browser(tmp_path / "absent.html")[0].startswith("no Chromium found on PATH")
