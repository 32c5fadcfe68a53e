"""``linnet site [RESULTS...] -o DIR``: render the Nestmodels pages as static HTML."""
from __future__ import annotations

import argparse
from pathlib import Path

from linnet.commands._checks import add_force_argument, path
from linnet.site.render import bundled_results, render_site
from linnet.site.runs import ARCHIVE


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("site", help="render the registry and results files as static HTML pages")
    parser.add_argument("results", nargs="*", type=lambda text: Path(path(text)),
                        help="results files, or directories of them (*.json), shown beside the published "
                             "results that ship with Linnet")
    parser.add_argument("--without-published", action="store_true",
                        help="leave out the published results (with results files given)")
    parser.add_argument("-o", "--output", type=lambda text: Path(path(text)), default=Path("site"),
                        help="where to write (default: site)")
    add_force_argument(parser)
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    pages = render_site(results_files(args.results, not args.without_published), args.output, force=args.force)
    print(f"wrote {len(pages)} pages to {args.output}; open {args.output / 'index.html'}")
    return 0


def results_files(given: list[Path], published: bool) -> list[Path]:
    """The files named, those in the directories named and their archive/ folders (superseded runs, which
    only the history pages show), and the published ones (always without any given)."""
    files = [f for p in given for f in (_in(p) if p.is_dir() else [p])]
    if published or not given:
        files += bundled_results()
    return list({f.resolve(): f for f in files}.values())  # one file named twice is one run


def _in(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.json")) + sorted((directory / ARCHIVE).glob("*.json"))
