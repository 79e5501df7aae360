# Run with main's src (80b6b6d): PYTHONPATH=<main>/src python make_old.py OUTDIR
import sys
from pathlib import Path

import torch

from kvlm.cache import CacheSpec, create_cache
from kvlm.cache.files import save_cache

WINDOWS = (4, 4, None, 4)
SPEC = CacheSpec(
    num_layers=4, num_kv_heads=2, head_dim=8, max_tokens=64, block_size=8, layer_windows=WINDOWS
)


def feed(cache, n, seed):
    g = torch.Generator().manual_seed(seed)
    step = cache.begin(n)
    for layer in range(4):
        k, v = (torch.randn(cache.batch, 2, n, 8, generator=g) for _ in range(2))
        step.for_layer(layer).update(layer, k, v)
    cache.commit(step)


out = Path(sys.argv[1])
for mode, name in (("contiguous", "hybrid-contiguous.kv"), ("int8", "hybrid-int8.kv")):
    cache = create_cache(mode, SPEC)
    feed(cache, 38, seed=1)
    if mode == "contiguous":
        cache.fork(2)
    feed(cache, 3, seed=2)
    save_cache(cache, out / name, "fp-old", extra={"made_by": "kvlm 80b6b6d"})
    print(name, cache.num_tokens, cache.batch, cache.layout)
