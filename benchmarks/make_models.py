"""Write random-weight GGUF files of real model shapes (kvlm.bench.models) for the speed and
memory figures of docs/BENCHMARKS.md: the files `kvlm bench --suite DIR` runs (it writes
the missing ones itself; this writes them ahead, or other shapes and types).

    python benchmarks/make_models.py --out /tmp/models                    # every shape x type
    python benchmarks/make_models.py --out /tmp/models --shapes qwen3-1.7b --types Q4_K_M
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvlm.bench.models import FILE_TYPES, SHAPES
from kvlm.bench.suite import SUITE_SHAPES, SUITE_TYPES, suite_models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", default=",".join(SUITE_SHAPES), help=", ".join(SHAPES))
    p.add_argument("--types", default=",".join(SUITE_TYPES), help=", ".join(FILE_TYPES))
    args = p.parse_args()
    files = suite_models(args.out, args.shapes.split(","), args.types.split(","), False, sys.stderr)
    for path in files:
        print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
