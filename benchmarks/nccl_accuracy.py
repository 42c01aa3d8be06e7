"""parsim's collective predictions against published nccl-tests results.

Reads parsim/validation/nccl_tests.yaml (each row: a published busbw with its
source, hardware and NCCL version), predicts the same collective, size and
node count on the matching built-in cluster, and prints the table of
docs/nccl-accuracy.md with the median |error|.

Run:  python benchmarks/nccl_accuracy.py            (markdown table)
      python benchmarks/nccl_accuracy.py --by-size  (median |error| per message size too)
"""

from __future__ import annotations

import argparse
import statistics

from parsim.units import format_size
from parsim.validation.nccl_tests import compare, markdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--by-size", action="store_true", help="also print the median |error| per size class")
    args = parser.parse_args()
    rows = compare()
    print(markdown(rows))
    if args.by_size:
        classes = {"<= 16 MiB": lambda s: s <= 16 << 20, "128 MiB": lambda s: 16 << 20 < s <= 128 << 20,
                   ">= 1 GiB": lambda s: s >= 1 << 30}
        print()
        for name, test in classes.items():
            errors = [abs(r.error) for r in rows if test(r.size)]
            if errors:
                print(f"{name:>9}: median |error| {statistics.median(errors):.1%} over {len(errors)} rows "
                      f"(sizes {', '.join(sorted({format_size(r.size) for r in rows if test(r.size)}))})")


if __name__ == "__main__":
    main()
