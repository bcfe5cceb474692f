"""`moejax-report WORKDIR [--out DIR] [--json]`: plots and a markdown summary of a training run."""

from __future__ import annotations

import argparse
import json
import sys

PROG = "moejax-report"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split(":", 1)[1].strip())
    ap.add_argument("workdir")
    ap.add_argument("--out", default=None, help="output folder (default WORKDIR/report)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    from moejax.report import ReportError, write_report

    try:
        summary = write_report(args.workdir, args.out)
    except ReportError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for k, v in summary.items():
            if k != "files":
                print(f"{k:>26}: {v:.4g}" if isinstance(v, float) else f"{k:>26}: {v}")
        print("wrote " + ", ".join(summary["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
