"""benchmark.py: every speed number in the README comes from here; the measuring lives in
bench/ (one file per section, bench/__init__.py says which), and `bench.cli.main` is its way in.

    python benchmark.py                 # 124M and 355M on the CPU: decoding, costs, speculative, serving
    python benchmark.py --quick         # tiny shapes, seconds (the test suite runs this)
    python benchmark.py --backend cupy  # on an NVIDIA GPU: all four sizes, next to transformers there
    python benchmark.py --help          # every flag; --only picks the sections
"""
import sys

from bench.cli import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    sys.exit(main())
