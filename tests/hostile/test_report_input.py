"""A quality report is untrusted input: it travels with an export from anywhere. Every report is
read through one typed, bounded schema (eprt.report.schema), refused by key; everything the page
prints is escaped; a comparison of runs of different models says so."""

import copy
import json
import os
import threading
from html.parser import HTMLParser

import pytest

from eprt.errors import ConfigError
from eprt.report import render
from eprt.report import reports as reports_module
from eprt.report.schema import REPORT, Fields, read_report_json
from eprt.storage.bounded import read_bounded
from tests.hf_utils import eprt_report

PAYLOAD = "<script>alert(1)</script><img src=x onerror=alert(2)>\"'&"


def refusal(tmp_path, monkeypatch, capsys, report) -> str:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    code, out = eprt_report(monkeypatch, capsys, path, "--out", tmp_path / "page.html")
    assert code == 2 and "Traceback" not in out, out
    assert not (tmp_path / "page.html").exists()
    assert out.startswith(f"error: {path}: ") and out.strip().endswith(
        "; give an export, a calibrated checkpoint or an eprt quality report's JSON"
    ), out
    return out


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("layers.0.relative_error", "<script>alert(1)</script>", "layers[0].relative_error is a string, not a number"),
        ("calibration.sources.0.share", "<img src=x onerror=alert(1)>", "calibration.sources[0].share is a string"),
        ("groups.0.modules", ["a", "b"], "groups[0].modules is a list, not an integer"),
        ("experts.0.tokens", "1,2", "experts[0].tokens is a string, not a list"),
        ("experts.0.unreached.0", None, "experts[0].unreached[0] is null, not an integer"),
        ("kl_mean", True, "kl_mean is a boolean, not a number"),
        ("layers.0.top.0.module", 7, "layers[0].top[0].module is an integer, not a string"),
        ("preview", [], "preview is a list, not an object"),
        ("eval.tokens", -1, "eval.tokens is -1, outside 0 to"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_by_key(quality_report, tmp_path, monkeypatch, capsys, key, value, named):
    r = copy.deepcopy(quality_report)
    r.setdefault("experts", [])[0]["unreached"] = [0]
    *parents, last = key.split(".")
    at = r
    for k in parents:
        at = at[int(k)] if isinstance(at, list) else at[k]
    at[int(last) if isinstance(at, list) else last] = value
    assert f"{named}" in refusal(tmp_path, monkeypatch, capsys, r)


def required_keys(spec=REPORT, at=()):
    """Every key the schema requires, as a path (lists by their first item)."""
    for key, sub in spec.required.items():
        yield (*at, key)
        if isinstance(sub, Fields):
            yield from required_keys(sub, (*at, key))
        elif isinstance(getattr(sub, "item", None), Fields):
            yield from required_keys(sub.item, (*at, key, 0))


@pytest.mark.parametrize("path", list(required_keys()), ids=lambda p: ".".join(map(str, p)))
def test_every_required_key_missing_is_refused_by_name(quality_report, tmp_path, monkeypatch, capsys, path):
    r = copy.deepcopy(quality_report)
    at = r
    for k in path[:-1]:
        at = at[k]
    del at[path[-1]]
    named = ".".join(str(k) for k in path).replace(".0.", "[0].").replace(".0", "[0]")
    assert f"{named} is missing" in refusal(tmp_path, monkeypatch, capsys, r)


def strings_replaced(value, text):
    if isinstance(value, dict):
        return {k: strings_replaced(v, text) for k, v in value.items()}
    if isinstance(value, list):
        return [strings_replaced(v, text) for v in value]
    return text if isinstance(value, str) else value


class Markup(HTMLParser):
    def __init__(self, page):
        super().__init__()
        self.tags, self.handlers = set(), []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.handlers += [a for a, _ in attrs if a.startswith("on")]
        if tag == "img":
            assert dict(attrs)["src"].startswith("data:image/svg+xml;base64,")


@pytest.mark.parametrize("draw", [False, True])
def test_every_string_the_page_prints_is_escaped(quality_report, draw):
    if draw:
        pytest.importorskip("matplotlib")
    hostile = strings_replaced(quality_report, PAYLOAD)
    r = read_report_json(hostile)
    for page in (render([(PAYLOAD, r)], draw), render([(PAYLOAD, r), ("other", r)], draw)):
        markup = Markup(page)
        assert "script" not in markup.tags and markup.handlers == []
        assert PAYLOAD not in page and "&lt;script&gt;" in page


def test_a_report_claiming_300_x_1000_experts_is_refused_before_any_page(quality_report, tmp_path, monkeypatch, capsys):
    r = copy.deepcopy(quality_report)
    template = r["experts"][0]
    r["experts"] = [{**template, "module": f"model.layers.{i}.mlp.experts", "tokens": [0] * 1000} for i in range(300)]
    assert "experts counts 300000 experts in all, more than 262144" in refusal(tmp_path, monkeypatch, capsys, r)


def test_a_ragged_token_map_is_refused(quality_report, tmp_path, monkeypatch, capsys):
    r = copy.deepcopy(quality_report)
    r["experts"].append({**r["experts"][0], "tokens": [1, 2]})
    assert f"experts[{len(r['experts']) - 1}].tokens counts 2 experts, layer 0 8" in refusal(
        tmp_path, monkeypatch, capsys, r
    )


def test_an_oversized_report_is_refused_unread(quality_report, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reports_module, "MAX_REPORT_BYTES", 1024)
    assert "larger than 1.00 KiB, the most eprt reads of such a file" in refusal(
        tmp_path, monkeypatch, capsys, quality_report
    )


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    outcome = []
    read = lambda: outcome.append(pytest.raises(ConfigError, read_bounded, str(fifo), 1 << 20, "give a file"))  # noqa: E731
    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert outcome, "reading a FIFO blocked"
    assert "not a regular file" in str(outcome[0].value)


def test_a_comparison_of_different_models_says_so(quality_report, tmp_path, monkeypatch, capsys):
    other = copy.deepcopy(quality_report)
    other["model"] = {**other["model"], "manifest_sha256": "0" * 64}
    paths = []
    for name, r in (("a", quality_report), ("b", quality_report), ("c", other)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(r))
    code, _ = eprt_report(monkeypatch, capsys, paths[0], paths[1], "--out", tmp_path / "same.html")
    assert code == 0 and 'id="different-models"' not in (tmp_path / "same.html").read_text()
    code, _ = eprt_report(monkeypatch, capsys, paths[0], paths[2], "--out", tmp_path / "cmp.html")
    page = (tmp_path / "cmp.html").read_text()
    assert code == 0 and 'id="different-models"' in page and "their numbers do not compare" in page
    assert "differ: model" in page


def test_the_report_names_its_model(quality_report):
    assert set(quality_report["model"]) == {"model_type", "manifest_sha256"}
    assert (
        quality_report["model"]["model_type"] == "qwen3_moe" and len(quality_report["model"]["manifest_sha256"]) == 64
    )


def test_the_page_shows_each_experts_error_beside_the_token_map_and_the_size(quality_report):
    pytest.importorskip("matplotlib")
    page = render([("run", read_report_json(quality_report))])
    assert 'id="chart-experts-0"' in page and 'id="chart-expert-errors-0"' in page
    size = quality_report["size"]
    for key in ("linear_parameters", "bytes_unquantized", "bytes_quantized", "bits_per_parameter"):
        assert f'data-key="{key}" data-value="{size[key]!r}"' in page
    # every routed expert of every MoE layer (those the token map shows) has its error: the tiny
    # model's held-out tokens reach them all
    errors = {m: v for x in quality_report["layers"] for m, v in x.get("expert_errors", {}).items()}
    assert list(errors) == [e["module"] for e in quality_report["experts"]]
    assert all(len(v) == 8 and all(isinstance(x, float) for x in v) for v in errors.values())
    top = {t["module"]: t["relative_error"] for x in quality_report["layers"] for t in x["top"]}
    for module, error in top.items():  # the ranked experts' errors are the map's
        moe, _, expert = module.rpartition(".")
        layer = int(module.split(".")[2])
        if moe.endswith("experts"):
            assert quality_report["layers"][layer]["expert_errors"][moe][int(expert)] == error


def test_the_size_counts_the_linear_weights_of_the_export(quality_report):
    """bits per parameter = the quantized bytes over the parameters; NVFP4's 4 bits a weight, one
    fp8 scale per 16 and fp32 per-tensor scales make it a little over 4.5."""
    size = quality_report["size"]
    assert size["bytes_unquantized"] == 2 * size["linear_parameters"]
    assert size["bits_per_parameter"] == pytest.approx(
        8 * size["bytes_quantized"] / size["linear_parameters"], rel=1e-4
    )
    assert 4.5 < size["bits_per_parameter"] < 4.6
