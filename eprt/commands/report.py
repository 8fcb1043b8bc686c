"""The PTQ quality report as a page, drawn again from its JSON, or several compared side by side.

    eprt-report EXPORT                          # EXPORT/eprt_quality.html, from EXPORT/eprt_quality.json
    eprt-report MAX GPTQ AWQ --out cmp.html     # several runs on the same held-out data, side by side

Each EXPORT is an export, a calibrated eprt checkpoint or a report's JSON file. Runs compared
must have measured on the same held-out data (the same data and sizes, or the same --eval FILE).
Charts need matplotlib (pip install "eprt[report]"); without it the page says so and holds the
numbers only.
"""

import sys

from eprt.cli import command_parser, run
from eprt.errors import ConfigError


def report() -> int:
    ap = command_parser(__doc__, "quality")
    ap.add_argument(
        "exports",
        nargs="+",
        metavar="EXPORT",
        help="an export, a calibrated eprt checkpoint or an eprt quality report's JSON file",
    )
    ap.add_argument("--out", help="the page to write (default, for one EXPORT: beside its JSON; required for several)")
    a = ap.parse_args()
    from eprt.report import label, page_path, read_report, same_held_out, write_page  # after --help

    if len(a.exports) > 1 and not a.out:
        raise ConfigError("several EXPORTs: name the comparison page with --out PAGE.html")
    found = [read_report(path) for path in a.exports]
    if len(found) == 1:
        reports = [(label(found[0][1]), found[0][1])]
    else:
        reports = [(path, r) for path, (_, r) in zip(a.exports, found)]
        same_held_out(reports)
    print(write_page(a.out or page_path(found[0][0]), reports))
    return 0


def main() -> int:
    return run(report)


if __name__ == "__main__":
    sys.exit(main())
