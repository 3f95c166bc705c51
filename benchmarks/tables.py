"""Rewrite the results tables of the README and the manual from the results files (src/kascade/results/).

    python -m benchmarks.tables            # rewrite every table block of README.md and docs/
    python -m benchmarks.tables --check    # rewrite nothing; exit 1 naming the pages whose tables are stale

A table block is ``<!-- results:NAME [ARG ...] -->`` ... ``<!-- /results -->`` (``benchmarks.common.tables`` lists the
names). After a new run, copy its figures into the results file of its card (or accuracy.json), then run this.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common.tables import ROOT, pages, render


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page's tables are stale")
    args = p.parse_args(argv)
    stale = []
    for page in pages():
        text = page.read_text()
        new = render(text)
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
            if not args.check:
                page.write_text(new)
    print(("stale: " if args.check else "rewrote: ") + (", ".join(stale) or "nothing"))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
