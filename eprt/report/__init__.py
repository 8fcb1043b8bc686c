"""The PTQ quality report (eprt.quant.quality writes its JSON) as a page people look at:
`render` draws one report or several side by side, `write_page` writes it beside its JSON, and
`read_report` finds the JSON of an export, a calibrated checkpoint or a file and reads it through
one typed, bounded schema (`checked`, eprt.report.schema)."""

from eprt.report.page import render
from eprt.report.reports import checked, label, page_path, read_report, same_held_out, write_page

__all__ = ["checked", "label", "page_path", "read_report", "render", "same_held_out", "write_page"]
