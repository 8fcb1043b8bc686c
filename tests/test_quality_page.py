"""The quality report as a page: written beside the JSON by PTQ and carried by the export, its
numbers the JSON's exactly, every chart present, drawn again by `eprt-report` (one run, or several
compared on the same held-out data), and rendered by a real headless browser where one is installed."""

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.calibrated import QUALITY_FILE
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.report import render
from eprt.storage.checkpoint import MANIFEST
from eprt.storage.hf_files import QUALITY, QUALITY_PAGE
from eprt.testing.tiny import make_tiny
from tests.hf_utils import eprt_report

CHATS = [
    [
        {"role": "user", "content": f"Question {i}: where do the tokens go?"},
        {"role": "assistant", "content": "To the rank that holds their expert. " * (i + 1)},
    ]
    for i in range(12)
]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def ptq(ck, out, **kw):
    args = dict(
        kv_cache="fp8",
        calib_size=6,
        seq_len=24,
        group_tokens=48,
        dtype="fp32",
        progress=False,
        eval_size=3,
        preview="The river",
    )
    return run_ptq(ParallelState.single("cpu"), PTQArgs(ck, "nvfp4", out, **{**args, **kw}))["quality"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """qwen3_moe calibrated on chat conversations: with max (experts no token reached marked), and
    with gptq (every expert under --gptq-min-tokens kept at max rounding), each exported."""
    pytest.importorskip("matplotlib")
    d = tmp_path_factory.mktemp("page")
    ck = convert_hf(make_tiny("qwen3_moe", str(d / "hf")), str(d / "ck"), progress=False)
    chat = d / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    out = {}
    for algorithm in ("max", "gptq"):
        q = str(d / algorithm)
        ptq(ck, q, algorithm=algorithm, calib=str(chat))
        out[algorithm] = (q, export_hf(q, q + "-hf", progress=False))
    return out


class Cells(HTMLParser):
    """Every table cell's (table class, data-key, data-value), every image's (id, src), the sections' ids."""

    def __init__(self, page: str):
        super().__init__()
        self.cells, self.images, self.sections, self.table = [], {}, [], None
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self.table = a.get("class")
        elif tag == "td" and "data-value" in a:
            self.cells.append((self.table, a["data-key"], a["data-value"]))
        elif tag == "img":
            self.images[a["id"]] = a["src"]
        elif tag == "section":
            self.sections.append(a["id"])

    def values(self, table: str, key: str) -> list:
        return [json.loads(v) for t, k, v in self.cells if t == table and k == key]


def test_ptq_writes_the_page_beside_the_json_and_the_export_carries_both(runs):
    q, hf = runs["max"]
    assert Path(hf, QUALITY_PAGE).read_bytes() == Path(q, "quality.html").read_bytes()
    assert Path(hf, QUALITY).read_bytes() == Path(q, QUALITY_FILE).read_bytes()
    assert check_export(hf) == []


def test_the_pages_numbers_are_the_jsons(runs):
    q, _ = runs["gptq"]
    r = json.loads(Path(q, QUALITY_FILE).read_text())
    page = Cells(Path(q, "quality.html").read_text())
    for key in ("kl_mean", "kl_p99", "top1_agreement"):
        assert page.values("headline", key) == [r[key]], key
    assert page.values("headline", "perplexity.unquantized") == [r["perplexity"]["unquantized"]]
    assert page.values("headline", "perplexity.quantized") == [r["perplexity"]["quantized"]]
    assert page.values("headline", "eval.tokens") == [r["eval"]["tokens"]]
    assert page.values("layers", "relative_error") == [x["relative_error"] for x in r["layers"]]
    assert page.values("top", "relative_error") == [t["relative_error"] for x in r["layers"] for t in x["top"]]
    assert page.values("top", "token_share") == [t["token_share"] for x in r["layers"] for t in x["top"]]
    assert page.values("tokens", "max") == [max(e["tokens"]) for e in r["experts"]]
    assert page.values("sources", "sequences") == [s["sequences"] for s in r["calibration"]["sources"]]
    assert page.values("groups", "modules") == [g["modules"] for g in r["groups"]]


def test_the_report_records_what_the_page_shows(runs):
    r = json.loads(Path(runs["gptq"][0], QUALITY_FILE).read_text())
    assert r["recipe"]["name"] == "nvfp4" and {g["format"] for g in r["groups"]} == {"nvfp4"}
    (source,) = r["calibration"]["sources"]
    assert source["path"].endswith("chat.jsonl") and source["documents"] > 1 and source["sequences"] == 6
    manifest = json.loads(Path(runs["gptq"][0], MANIFEST).read_text())  # the calibrated checkpoint records it too
    assert manifest["quantization"]["calibration"]["sources"] == [source]
    assert r["preview"]["prompt"] == "The river" and r["preview"]["before"] and r["preview"]["after"]
    assert [e["module"] for e in r["experts"]] == ["model.layers.0.mlp.experts", "model.layers.2.mlp.experts"]
    for e in r["experts"]:  # 6 x 24 tokens top-2 over 8 experts: none reaches 128, so GPTQ falls back for each
        assert sum(e["tokens"]) == 6 * 24 * 2 and e["gptq_max_rounding"] == list(range(8))
    html = Path(runs["gptq"][0], "quality.html").read_text()
    assert "GPTQ&#x27;s fallback: max rounding" in html and "The river" in html


def test_every_chart_is_an_embedded_svg(runs):
    page = Cells(Path(runs["max"][0], "quality.html").read_text())
    assert page.sections == ["headline", "layers", "modules", "experts", "recipe", "data", "preview"]
    assert set(page.images) == {"chart-layers", "chart-experts-0", "chart-expert-errors-0"}
    for src in page.images.values():
        assert src.startswith("data:image/svg+xml;base64,")
        assert b"<svg" in base64.b64decode(src.split(",", 1)[1])
    assert "http" not in Path(runs["max"][0], "quality.html").read_text().replace("http://www.w3.org", "")


def test_without_matplotlib_the_page_says_so_and_keeps_every_number(runs, monkeypatch):
    r = json.loads(Path(runs["max"][0], QUALITY_FILE).read_text())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    page = render([("max", r)])
    assert 'id="no-charts"' in page and "matplotlib is not installed" in page and "<img" not in page
    assert Cells(page).values("layers", "relative_error") == [x["relative_error"] for x in r["layers"]]


def test_text_from_the_run_is_escaped(runs):
    r = json.loads(Path(runs["max"][0], QUALITY_FILE).read_text())
    r["preview"]["after"] = "<script>alert(1)</script>"
    page = render([("<b>run</b>", r)], draw=False)
    assert "<script" not in page and "&lt;script&gt;" in page and "<b>run" not in page


# --- eprt-report ------------------------------------------------------------------------------------


def test_eprt_report_draws_the_same_page_again(runs, tmp_path, monkeypatch, capsys):
    _, hf = runs["max"]
    copy = shutil.copytree(hf, tmp_path / "export")
    (copy / QUALITY_PAGE).unlink()
    code, out = eprt_report(monkeypatch, capsys, copy)
    assert code == 0 and out.strip() == str(copy / QUALITY_PAGE)
    assert (copy / QUALITY_PAGE).read_bytes() == Path(hf, QUALITY_PAGE).read_bytes()
    code, _ = eprt_report(monkeypatch, capsys, runs["max"][0], "--out", tmp_path / "from-ckpt.html")
    assert code == 0 and (tmp_path / "from-ckpt.html").read_bytes() == Path(hf, QUALITY_PAGE).read_bytes()


def test_eprt_report_compares_runs_side_by_side(runs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "cmp.html"
    code, _ = eprt_report(monkeypatch, capsys, runs["max"][1], runs["gptq"][1], "--out", out)
    assert code == 0
    page = Cells(out.read_text())
    reports = [json.loads(Path(runs[a][1], QUALITY).read_text()) for a in ("max", "gptq")]
    assert page.values("headline", "kl_mean") == [r["kl_mean"] for r in reports]
    layers = page.values("layers", "relative_error")
    assert layers == [r["layers"][i]["relative_error"] for i in range(len(reports[0]["layers"])) for r in reports]
    assert set(page.images) == {
        "chart-layers",
        *(f"chart-{c}-{i}" for c in ("experts", "expert-errors") for i in (0, 1)),
    }
    assert out.read_text().count(str(runs["max"][1])) >= 1 and out.read_text().count(str(runs["gptq"][1])) >= 1


def test_eprt_report_refusals(runs, tmp_path, monkeypatch, capsys):
    other = json.loads(Path(runs["gptq"][1], QUALITY).read_text())
    other["eval_ids_sha256"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(other))
    code, out = eprt_report(monkeypatch, capsys, runs["max"][1], tmp_path / "other.json", "--out", tmp_path / "c.html")
    assert code == 2 and "other.json: measured on other held-out data than" in out and "same --eval FILE" in out
    code, out = eprt_report(monkeypatch, capsys, runs["max"][1], runs["gptq"][1])
    assert code == 2 and "several EXPORTs: name the comparison page with --out" in out
    (tmp_path / "bad.json").write_text(json.dumps({"kl_mean": 0.1}))
    code, out = eprt_report(monkeypatch, capsys, tmp_path / "bad.json")
    assert code == 2 and "bad.json: eval is missing: not an eprt quality report" in out
    code, out = eprt_report(monkeypatch, capsys, tmp_path)
    assert code == 2 and f"{tmp_path}: holds no quality report" in out
    code, out = eprt_report(monkeypatch, capsys, tmp_path / "missing")
    assert code == 2 and "missing: no such file or directory" in out


# --- a real browser -----------------------------------------------------------------------------------


def browser() -> str | None:
    """A Chromium-family browser: $EPRT_BROWSER, or one on the PATH."""
    return os.environ.get("EPRT_BROWSER") or next(filter(None, map(shutil.which, BROWSERS)), None)


def test_a_headless_browser_renders_the_page(runs, tmp_path):
    exe = browser()
    if exe is None:
        pytest.skip(f"no Chromium-family browser installed ({', '.join(BROWSERS)} on the PATH, or $EPRT_BROWSER)")
    page = Path(runs["gptq"][1], QUALITY_PAGE).resolve().as_uri()
    common = [
        exe,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--enable-logging=stderr",
        "--v=0",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    shot = tmp_path / "page.png"
    done = subprocess.run(
        [*common, "--window-size=1200,3000", f"--screenshot={shot}", page], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.stat().st_size > 20_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not re.search(r"CONSOLE|Uncaught|Failed to load resource", done.stderr), done.stderr[-2000:]
    dom = subprocess.run([*common, "--dump-dom", page], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0 and dom.stdout.count('class="chart"') == 2
    assert all(f'id="{s}"' in dom.stdout for s in ("headline", "layers", "modules", "experts", "preview"))
    if os.environ.get("EPRT_SCREENSHOT_DIR"):  # keep it to look at
        shutil.copy(shot, os.environ["EPRT_SCREENSHOT_DIR"])
