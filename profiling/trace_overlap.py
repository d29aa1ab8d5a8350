"""Does layer l+1's copy run under layer l's compute? Read it from a trace, not by eye.

    python profiling/trace_overlap.py decode.json [--require 0.5]

Prints, per layer l, the fraction of layer l+1's copy-span time that overlaps layer l's
compute spans (streamrt.trace.overlap_fraction), then the overall figure (all copy time
with a layer, weighted by duration). With --require F, exits 1 when the overall figure is
below F (or there are no copies), so a CI job or a RESULTS.md run can assert the overlap.
"""

from __future__ import annotations

import argparse
import sys

from streamrt.errors import StreamrtError
from streamrt.trace import load_trace, overall_overlap, overlap_by_layer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help="Chrome trace JSON from `streamrt run --trace`")
    ap.add_argument("--require", type=float, default=None, metavar="F",
                    help="exit 1 unless the overall overlap fraction is at least F (0..1)")
    args = ap.parse_args(argv)
    try:
        trace = load_trace(args.file)
        rows = overlap_by_layer(trace)
        overall = overall_overlap(trace)
    except StreamrtError as e:
        print(f"streamrt: {e}", file=sys.stderr)
        return e.exit_code
    except (KeyError, TypeError, ValueError) as e:
        print(f"streamrt: trace {args.file}: malformed event ({e.__class__.__name__}: {e})", file=sys.stderr)
        return 2

    print(f"{'layer l':>7} {'copy(l+1) ms':>13} {'under compute(l) ms':>20} {'fraction':>9}")
    for layer, total, hidden in rows:
        print(f"{layer:>7} {total / 1e3:>13.3f} {hidden / 1e3:>20.3f} {hidden / total:>9.3f}")
    print(f"overall: {'no copy spans with a layer' if overall is None else f'{overall:.3f}'}")
    if args.require is not None and (overall is None or overall < args.require):
        print(f"FAIL: overall overlap below --require {args.require}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
