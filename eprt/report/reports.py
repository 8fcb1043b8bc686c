"""Finding, checking and writing quality reports.

A report is read from an export (its `eprt_quality.json`), a calibrated eprt checkpoint (the
file its manifest's `quantization.quality` names) or a JSON file; its page is written beside it,
the same name ending in `.html`.
"""

from __future__ import annotations

import os

from eprt.errors import ConfigError
from eprt.report.page import render
from eprt.report.schema import MAX_REPORT_BYTES, Refused, read_report_json
from eprt.storage.atomic import write_file
from eprt.storage.bounded import parse_json, read_bounded, read_json_object
from eprt.storage.checkpoint import MANIFEST
from eprt.storage.hf_files import QUALITY
from eprt.storage.paths import resolve_inside

WAY_OUT = "give an export, a calibrated checkpoint or an eprt quality report's JSON"


def report_path(path: str) -> str:
    """The report's JSON of `path`: an export, a calibrated checkpoint, or the file itself."""
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such file or directory; {WAY_OUT}")
    if os.path.isfile(path):
        return path
    if os.path.isfile(os.path.join(path, QUALITY)):
        return os.path.join(path, QUALITY)
    manifest = os.path.join(path, MANIFEST)
    if os.path.isfile(manifest):
        quantization = read_json_object(manifest, WAY_OUT).get("quantization") or {}
        if not quantization.get("quality"):
            raise ConfigError(
                f"{path}: a checkpoint without a quality report (not calibrated, or calibrated with "
                "--eval-size 0); calibrate with --eval-size N"
            )
        return resolve_inside(path, quantization["quality"], f"{manifest} (quantization.quality)")
    raise ConfigError(f"{path}: holds no quality report ({QUALITY} or an eprt checkpoint); {WAY_OUT}")


def read_report(path: str) -> tuple[str, dict]:
    """(the report's JSON file, the report as the schema reads it), refused by name unless it is one
    (eprt.report.schema)."""
    where = report_path(path)
    return where, checked(parse_json(read_bounded(where, MAX_REPORT_BYTES, WAY_OUT), where, WAY_OUT), where)


def checked(report, where: str) -> dict:
    """`report` as the schema reads it, or a ConfigError naming `where` and the key it refuses."""
    try:
        return read_report_json(report)
    except Refused as e:
        raise ConfigError(f"{where}: {e.at or 'the report'} {e.what}: not an eprt quality report; {WAY_OUT}") from None


def same_held_out(reports: list[tuple[str, dict]]) -> None:
    """Refuse to compare reports measured on different held-out data: by the held-out ids' digest
    where every report holds it, else by the held-out description."""
    first_label, first = reports[0]
    digests = [r.get("eval_ids_sha256") for _, r in reports]
    for label, r in reports[1:]:
        same = r["eval_ids_sha256"] == first["eval_ids_sha256"] if all(digests) else r["eval"] == first["eval"]
        if not same:
            raise ConfigError(
                f"{label}: measured on other held-out data than {first_label} ({r['eval']['data']!r} "
                f"vs {first['eval']['data']!r}); compare runs on the same data: the same --calib, "
                "--calib-size, --seq-len and --eval-size, or the same --eval FILE"
            )


def label(report: dict) -> str:
    """A report's name on its own page: its recipe and algorithm (a path would differ between two
    runs that measured the same)."""
    recipe, calibration = report.get("recipe") or {}, report.get("calibration") or {}
    return ", ".join(str(x) for x in (recipe.get("name"), calibration.get("algorithm")) if x) or "PTQ run"


def page_path(json_path: str) -> str:
    """Where the page of the report `json_path` goes: beside it, ending in .html."""
    return os.path.splitext(json_path)[0] + ".html"


def write_page(path: str, reports: list[tuple[str, dict]], draw: bool | None = None) -> str:
    """Write the page of `reports` to `path` whole or not at all (eprt.storage.atomic); returns `path`."""
    write_file(path, render(reports, draw), "the report's page", "name another page with --out")
    return path
