#!/usr/bin/env python3
"""Check an HTML report in headless Chromium (see `ropelab.claims.browser`).

usage: python scripts/check_html_in_browser.py FILE.html [--screenshot OUT.png]

Exit status 0 when every check passes; otherwise one line per problem and exit status 1.
"""

from __future__ import annotations

import argparse
import sys

from ropelab.claims.browser import check_in_browser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("html", help="the page to check")
    parser.add_argument("--screenshot", metavar="OUT.png", help="also write a screenshot of the page here")
    args = parser.parse_args(argv)
    problems = check_in_browser(args.html, args.screenshot)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
