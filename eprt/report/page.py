"""The quality report as a page: one self-contained HTML file (no script, no network: the charts
are embedded SVG), from one report or several side by side.

Every number shown is a value of the report's JSON: each cell carries it exactly in
`data-value` (Python's repr of the float), and shows it rounded. Sections a report does not
hold (one written before they were recorded) say so instead of showing nothing.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

from eprt.report import charts

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0 1em; } caption { text-align: left; font-weight: 600; }
td, th { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.side { display: flex; flex-wrap: wrap; gap: 2em; } .side > div { flex: 1 1 30em; }
img.chart { max-width: 100%; } pre { background: #f6f6f6; padding: 0.5em; white-space: pre-wrap; }
.note { color: #555; font-style: italic; } .warning { color: #a00; font-weight: 600; }
"""
NOT_RECORDED = "not recorded in this report (written by an eprt that did not record it)"


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def number(value: float | int | None, key: str = "", digits: int = 4) -> str:
    """A table cell holding `value` exactly (data-value) and rounded (shown)."""
    if value is None:
        return '<td class="n">-</td>'
    shown = f"{value:.{digits}g}" if isinstance(value, float) else str(value)
    return f'<td class="n" data-key="{esc(key)}" data-value="{esc(repr(value))}">{esc(shown)}</td>'


def table(header: list[str], rows: list[list[str]], caption: str = "", cls: str = "") -> str:
    """`rows` of ready cells (`<td>...`), under `header`."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join(f"<tr>{''.join(r)}</tr>" for r in rows)
    cap = f"<caption>{esc(caption)}</caption>" if caption else ""
    return f'<table class="{cls}">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def text(value: Any) -> str:
    return f"<td>{esc(value)}</td>"


def chart(uri: str, chart_id: str, alt: str) -> str:
    return f'<figure><img class="chart" id="{chart_id}" alt="{esc(alt)}" src="{uri}"></figure>'


def side_by_side(reports: list[tuple[str, dict]], part: Callable[[int, str, dict], str]) -> str:
    """One block per report, each headed by its label when there are several."""
    if len(reports) == 1:
        return part(0, *reports[0])
    return (
        '<div class="side">'
        + "".join(f"<div><h3>{esc(label)}</h3>{part(i, label, r)}</div>" for i, (label, r) in enumerate(reports))
        + "</div>"
    )


# --- the sections -----------------------------------------------------------------------------------


def model_name(r: dict) -> str:
    """The model a report measured, in words (its identity: eprt.quant.run.ptq.model_identity)."""
    m = r.get("model")
    if m is None:
        return "model not recorded"
    return f"{m.get('name') or m['model_type']} ({m['model_type']}, manifest {m['manifest_sha256'][:12]})"


# what tells runs apart: (column, the value of a report)
RUN_SETTINGS = (
    ("model", model_name),
    ("recipe", lambda r: (r.get("recipe") or {}).get("name", "-")),
    ("algorithm", lambda r: (r.get("calibration") or {}).get("algorithm", "-")),
    ("calibration data", lambda r: (r.get("calibration") or {}).get("data", "-")),
    ("sequences x length", lambda r: "{samples} x {seq_len}".format(**r["calibration"]) if "calibration" in r else "-"),
    ("bits per parameter", lambda r: f"{r['size']['bits_per_parameter']:.4g}" if "size" in r else "-"),
)


def runs_section(reports: list[tuple[str, dict]]) -> str:
    """A comparison: a row per run (what it was and its headline numbers), the settings that differ
    between the runs, and a warning where the runs are not of one model."""
    rows = [
        [
            text(label),
            *(text(get(r)) for _, get in RUN_SETTINGS),
            number(r["kl_mean"], "kl_mean"),
            number(r["top1_agreement"], "top1_agreement"),
            number(r["perplexity"]["quantized"], "perplexity.quantized"),
        ]
        for label, r in reports
    ]
    out = table(
        ["run", *(name for name, _ in RUN_SETTINGS), "KL mean", "top-1 agreement", "perplexity, quantized"],
        rows,
        cls="runs",
    )
    differ = [name for name, get in RUN_SETTINGS if len({get(r) for _, r in reports}) > 1]
    out += f'<p class="note" id="differences">{esc("differ: " + ", ".join(differ) if differ else "the runs differ in no setting shown")}</p>'
    models = {(r.get("model") or {}).get("manifest_sha256") for _, r in reports}
    if len(models) > 1 or None in models:
        out += (
            '<p class="warning" id="different-models">'
            + esc(
                "These runs are not known to be of one model ("
                + "; ".join(f"{label}: {model_name(r)}" for label, r in reports)
                + "): their numbers do not compare."
            )
            + "</p>"
        )
    return out


def headline(reports: list[tuple[str, dict]]) -> str:
    rows = [
        ("KL mean", lambda r: r["kl_mean"], "kl_mean"),
        ("KL p99", lambda r: r["kl_p99"], "kl_p99"),
        ("top-1 agreement", lambda r: r["top1_agreement"], "top1_agreement"),
        ("perplexity, unquantized", lambda r: r["perplexity"]["unquantized"], "perplexity.unquantized"),
        ("perplexity, quantized", lambda r: r["perplexity"]["quantized"], "perplexity.quantized"),
        ("held-out tokens", lambda r: r["eval"]["tokens"], "eval.tokens"),
    ]
    if any("router_flips" in r for _, r in reports):  # AWQ's runs
        rows.append(("router choices AWQ's folds changed", lambda r: r.get("router_flips"), "router_flips"))
    body = [[text(name), *(number(get(r), key) for _, r in reports)] for name, get, key in rows]
    out = table(["", *(label for label, _ in reports)], body, cls="headline")
    data = {r["eval"]["data"] for _, r in reports}
    return out + "".join(f'<p class="note">held out: {esc(d)}</p>' for d in sorted(data))


def layer_section(reports: list[tuple[str, dict]], draw: bool) -> str:
    out = ""
    if draw:
        series = {label: [(x["layer"], x["relative_error"]) for x in r["layers"]] for label, r in reports}
        out += chart(charts.layer_errors(series), "chart-layers", "relative error per layer")
    layers = sorted({x["layer"] for _, r in reports for x in r["layers"]})
    by = [{x["layer"]: x for x in r["layers"]} for _, r in reports]
    rows = [
        [number(i, "layer"), *(number(b[i]["relative_error"] if i in b else None, "relative_error") for b in by)]
        for i in layers
    ]
    return out + table(["layer", *(label for label, _ in reports)], rows, cls="layers")


def worst_modules(_i: int, _label: str, r: dict) -> str:
    rows = [
        [
            number(x["layer"], "layer"),
            text(t["module"]),
            number(t["relative_error"], "relative_error"),
            number(t["token_share"], "token_share"),
        ]
        for x in r["layers"]
        for t in x["top"]
    ]
    return table(["layer", "module", "relative error", "token share"], rows, cls="top")


def experts_section(draw: bool) -> Callable[[int, str, dict], str]:
    def part(i: int, _label: str, r: dict) -> str:
        if "experts" not in r:
            return f'<p class="note">{NOT_RECORDED}</p>'
        experts = r["experts"]
        if not experts:
            return '<p class="note">no routed experts</p>'
        out = (
            chart(charts.expert_tokens(experts), f"chart-experts-{i}", "calibration tokens per expert") if draw else ""
        )
        errors = [(m, errs) for x in r["layers"] for m, errs in x.get("expert_errors", {}).items()]
        if draw and errors:  # the layer x expert error map beside the token map
            out = (
                f'<div class="side"><div>{out}</div><div>'
                f"{chart(charts.expert_errors(errors), f'chart-expert-errors-{i}', 'relative error per expert')}"
                "</div></div>"
            )
        rows = []
        for e in experts:
            if e["unreached"]:
                rows.append(
                    [
                        text(charts.short_module(e["module"])),
                        text(", ".join(map(str, e["unreached"]))),
                        text("no calibration token"),
                        text(e["unreached_handling"]),
                    ]
                )
            if e["gptq_max_rounding"]:
                min_tokens = r.get("calibration", {}).get("gptq_min_tokens")
                rows.append(
                    [
                        text(charts.short_module(e["module"])),
                        text(", ".join(map(str, e["gptq_max_rounding"]))),
                        text(f"fewer than {min_tokens} tokens"),
                        text("GPTQ's fallback: max rounding (--gptq-min-tokens)"),
                    ]
                )
        out += (
            table(["layer", "experts", "starved", "what was done"], rows, cls="starved")
            if rows
            else '<p class="note">no expert starved</p>'
        )
        tokens = [
            [
                text(charts.short_module(e["module"])),
                number(min(e["tokens"]), "min"),
                number(sorted(e["tokens"])[len(e["tokens"]) // 2], "median"),
                number(max(e["tokens"]), "max"),
            ]
            for e in experts
        ]
        return out + table(["layer", "min", "median", "max"], tokens, "calibration tokens per expert", "tokens")

    return part


def recipe_section(_i: int, _label: str, r: dict) -> str:
    if "recipe" not in r:
        return f'<p class="note">{NOT_RECORDED}</p>'
    recipe = r["recipe"]
    rows = [
        [text(g["group"]), text(g["format"]), text(g["algorithm"]), number(g["modules"], "modules")]
        for g in r.get("groups", [])
    ]
    head = (
        f"<p>recipe <b>{esc(recipe['name'])}</b>; KV cache: {esc(recipe.get('kv_cache') or 'unquantized')}"
        f"{'; multi-token-prediction layers quantized' if recipe.get('mtp') else ''}</p>"
    )
    if "auto_quantize" in r:  # the format search's choice (docs/quality.md, "Format search")
        s = r["auto_quantize"]
        head += (
            f"<p>chosen by --auto-quantize {s['budget_bits']:.4g} bits: {s['effective_bits']:.4g} effective bits per "
            f"active parameter, KL estimated {s['estimated_kl']:.4g}, measured {s['measured_kl']:.4g}</p>"
        )
    return head + size_table(r) + table(["module group", "format", "algorithm", "modules"], rows, cls="groups")


# the size the recipe gives the decoder layers' Linear weights (eprt.quant.size): (row, key)
SIZE_ROWS = (
    ("parameters", "linear_parameters"),
    ("bytes, bf16", "bytes_unquantized"),
    ("bytes, quantized", "bytes_quantized"),
    ("bits per parameter", "bits_per_parameter"),
    ("bits per active parameter", "bits_per_active_parameter"),
)


def size_table(r: dict) -> str:
    if "size" not in r:
        return f'<p class="note">size: {NOT_RECORDED}</p>'
    rows = [[text(name), number(r["size"][key], key)] for name, key in SIZE_ROWS]
    return table(["decoder Linear weights", ""], rows, cls="size")


def data_section(_i: int, _label: str, r: dict) -> str:
    if "calibration" not in r:
        return f'<p class="note">{NOT_RECORDED}</p>'
    c = r["calibration"]
    head = (
        f"<p>{esc(c['samples'])} sequences of {esc(c['seq_len'])} tokens ({esc(c['tokens'])} tokens), "
        f"algorithm {esc(c['algorithm'])}{', every expert on every token' if c.get('all_experts') else ''}</p>"
    )
    rows = [
        [
            text(s["path"]),
            number(s["share"], "share"),
            number(s["sequences"], "sequences"),
            number(s["held_out"], "held_out"),
            number(s["tokens"], "tokens"),
            number(s["documents"], "documents"),
            number(s["truncated"], "truncated"),
            text("yes" if s["repeated"] else "no"),
        ]
        for s in c.get("sources", [])
    ]
    return head + table(
        ["source", "share", "sequences", "held out", "tokens", "documents", "cut short", "repeated"],
        rows,
        cls="sources",
    )


def preview_section(_i: int, _label: str, r: dict) -> str:
    if "preview" not in r:
        return f'<p class="note">{NOT_RECORDED}</p>'
    p = r["preview"]
    if p is None:
        return '<p class="note">no preview in this run (--preview shows one)</p>'
    return (
        f'<p>prompt</p><pre class="prompt">{esc(p["prompt"])}</pre><p>before</p>'
        f'<pre class="before">{esc(p["before"])}</pre><p>after (fake-quantized)</p>'
        f'<pre class="after">{esc(p["after"])}</pre>'
    )


def render(reports: list[tuple[str, dict]], draw: bool | None = None) -> str:
    """The page of `reports` ([(label, report)]: one, or several compared on the same held-out data).
    `draw`: with charts (default: where matplotlib is installed)."""
    draw = charts.available() if draw is None else draw
    title = "eprt quality report" + (f": {reports[0][0]}" if len(reports) == 1 else f"s: {len(reports)} compared")
    no_charts = (
        ""
        if draw
        else (
            '<p class="note" id="no-charts">No charts: matplotlib is not installed (pip install '
            '"eprt[report]"); every number is in the tables.</p>'
        )
    )
    sections = [("runs", "Runs compared", runs_section(reports))] if len(reports) > 1 else []
    sections += [
        ("headline", "Headline", headline(reports)),
        ("layers", "Relative error per layer", layer_section(reports, draw)),
        ("modules", "The modules that contribute most, per layer", side_by_side(reports, worst_modules)),
        ("experts", "Calibration tokens per expert", side_by_side(reports, experts_section(draw))),
        ("recipe", "Recipe and formats", side_by_side(reports, recipe_section)),
        ("data", "Calibration data", side_by_side(reports, data_section)),
        ("preview", "Preview", side_by_side(reports, preview_section)),
    ]
    body = "".join(f'<section id="{key}"><h2>{esc(name)}</h2>{content}</section>' for key, name, content in sections)
    notes = "".join(f"<li>{esc(n)}</li>" for n in reports[0][1].get("notes", []))
    model = f'<p id="model">{esc(model_name(reports[0][1]))}</p>' if len(reports) == 1 else ""
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>'
        f'<body><h1>{esc(title)}</h1>{model}{no_charts}{body}<ul class="note">{notes}</ul></body></html>\n'
    )
