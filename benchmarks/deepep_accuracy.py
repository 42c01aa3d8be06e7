"""parsim's model of DeepEP's dispatch and combine against DeepEP's published H800 bandwidths.

Prints the table of docs/nccl-accuracy.md ("DeepEP's dispatch and combine"):
each published row (parsim/validation/deepep.py names the source and the
setting), parsim's logical bandwidth for the same call on hgx-h800, the error,
and the median |error|.

Run:  python benchmarks/deepep_accuracy.py
"""

from __future__ import annotations

import statistics

from parsim.validation.deepep import SOURCE, compare


def main() -> None:
    rows = compare()
    print(f"Source: {SOURCE}\n")
    print("| EP ranks | call | published GB/s | parsim GB/s | error | parsim time |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.ranks} | {r.call} | {r.published_GBps:.0f} ({r.link}) | {r.predicted_GBps:.1f} | "
              f"{r.error:+.1%} | {r.seconds * 1e3:.2f} ms |")
    errors = [abs(r.error) for r in rows]
    print(f"\nmedian |error| {statistics.median(errors):.1%}, max {max(errors):.1%} over {len(rows)} rows "
          f"(positive: parsim predicts a faster call)")


if __name__ == "__main__":
    main()
