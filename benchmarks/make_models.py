"""Write random-weight GGUF files of real model shapes (kvlm.bench.models) for the speed and
memory figures of docs/BENCHMARKS.md.

    python benchmarks/make_models.py --out /tmp/models                    # every shape x type
    python benchmarks/make_models.py --out /tmp/models --shapes qwen3-1.7b --types Q4_K_M
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvlm.bench.models import FILE_TYPES, SHAPES, write_model
from kvlm.loading.default import default_model_path

DEFAULT_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-0.6b", "qwen3-1.7b", "llama-3.2-1b")
DEFAULT_TYPES = ("Q4_0", "Q8_0", "Q4_K_M")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=", ".join(SHAPES))
    p.add_argument("--types", default=",".join(DEFAULT_TYPES), help=", ".join(FILE_TYPES))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes.split(","):
        for ftype in args.types.split(","):
            path = args.out / f"{shape}-{ftype}.gguf"
            if path.exists():
                print(f"{path} exists")
                continue
            t0 = time.perf_counter()
            write_model(shape, ftype, path, default_model_path())
            size = path.stat().st_size / 2**30
            print(f"{path}: {size:.2f} GiB in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
