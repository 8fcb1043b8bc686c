"""The README's table of supported models is the family table's: every `model_type` eprt reads has
its row, and no row names one it does not read."""

import re
from pathlib import Path

from eprt.families import FAMILIES, supported_model_types

README = Path(__file__).resolve().parent.parent / "README.md"


def table_rows() -> list[list[str]]:
    text = README.read_text()
    start = text.index("| `model_type` | model | eprt family |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_readme_lists_every_model_type_and_family_eprt_reads():
    rows = table_rows()
    listed_types = {t for row in rows for t in re.findall(r"`([a-z0-9_]+)`", row[0])}
    listed_families = {f for row in rows for f in re.findall(r"`([a-z0-9_]+)`", row[2])}
    assert listed_types == set(supported_model_types())
    assert listed_families == {f.name for f in FAMILIES}
