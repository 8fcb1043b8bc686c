"""Read eprt's documentation: its pages ship inside the package.

eprt-docs                 # the pages, one a line, with their titles
eprt-docs quickstart      # one page, as Markdown
eprt-docs --path          # the folder the pages are in
"""

import sys
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

from eprt.cli import command_parser, run
from eprt.errors import ConfigError


def folder() -> Traversable:
    """The pages: installed, eprt.docs (setup.py maps docs/ there); in a clone or an editable install,
    the docs/ folder beside the package."""
    try:
        return resources.files("eprt.docs")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "docs"


def pages() -> dict[str, str]:
    """Page name -> its text, for every page that ships with eprt."""
    return {p.name[:-3]: p.read_text(encoding="utf-8") for p in folder().iterdir() if p.name.endswith(".md")}


def title(text: str) -> str:
    first = text.lstrip().splitlines()[0] if text.strip() else ""
    return first.lstrip("# ").strip()


def docs(argv: list[str] | None = None) -> int:
    ap = command_parser(__doc__, "README")
    ap.add_argument("page", nargs="?", help="the page to print (default: list the pages)")
    ap.add_argument("--path", action="store_true", help="print the folder that holds the pages")
    a = ap.parse_args(argv)
    if a.path:
        print(folder())
        return 0
    found = pages()
    if a.page is None:
        width = max(map(len, found))
        for name in sorted(found):
            print(f"{name:<{width}}  {title(found[name])}")
        return 0
    page = a.page.removesuffix(".md")
    if page not in found:
        raise ConfigError(f"no documentation page {a.page!r}: the pages are {', '.join(sorted(found))}")
    sys.stdout.write(found[page])
    return 0


def main() -> int:
    return run(docs)


if __name__ == "__main__":
    sys.exit(main())
