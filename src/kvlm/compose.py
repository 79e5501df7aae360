"""What composes with what: every cache variant (each cache mode, and the storage modes at
each --kv-dtype) against every feature, and why a pair is refused.

The lists come from the code (kvlm.cache.factory.CACHE_MODES, the K/V dtypes, the modes
speculation cannot run on, the fused step's caches), so a new mode joins the grid by
itself. tests/test_composition.py runs every cell: a composing cell gives the tokens of
the same variant without the feature; a refused one raises an error whose message says
why. (Nobody asks for the fused step: where it does not run, `LLM.describe()
["decode_step"]` and `kvlm generate --json` say why.)
`python -m kvlm.compose` prints the grid as the table in docs/COMPOSITION.md.
"""

from __future__ import annotations

from kvlm.cache.factory import CACHE_MODES, FUSED_MODES, ONE_GEOMETRY, OWN_GEOMETRY_REFUSED
from kvlm.cache.recurrent import NO_ROLLBACK
from kvlm.llm import NO_SPECULATION
from kvlm.model import fused
from kvlm.model.mla import KEYS_UNROTATED
from kvlm.settings import table

STORAGE_MODES = ("contiguous", "paged")  # modes whose K/V dtype is --kv-dtype's
# K/V storage dtypes of the grid, K and V alike (fp32, the compute dtype: the rows without
# one). q4 is held elsewhere (tests/test_kv_q4.py, test_fused_arch.py): on the grid's tiny
# random hybrid model its K/V stray from the no-cache oracle past the fused cell's top-5
# rule, on the torch step and the fused step alike
KV_DTYPES = ("bf16", "fp16", "int8")

FEATURES = {
    "batching": "LLM.generate of several prompts (the batch engine, or one after another)",
    "chunked prefill": "the prompt fed in chunks (prefill_chunk)",
    "n>1 fan-out": "n samples from one prefill (sample i seeded seed + i)",
    "prefix reuse": "a conversation's next turn keeps its cached prefix (ChatSession)",
    "save/load": "a conversation's cache written to a file and read back",
    "rollback": "cached tokens rolled back and others fed in their place",
    "speculative decoding": "prompt-lookup drafts checked and rolled back (LLM(speculative=))",
    "fused low-bit step": "decode steps in kvlm's fused C step (low-bit weights on the CPU)",
}


# The models of the grid: the Llama family (every layer one attention), a hybrid one
# (layers with a window of 8 and layers that see the whole context), a conv one (short
# convolutions beside attention), a state one (gated DeltaNets, a recurrent state a
# sequence, beside attention), an experts one (a mixture of experts for every layer's
# FFN), a latent one (latent attention: each token's compressed latent and key part
# cached, K and V made from them) and a shared one (layers of their own head sizes, K = V
# layers keeping one tensor, the last layers reading an earlier layer's K/V, per-layer
# inputs): tests/test_composition.py builds them
MODELS = ("llama", "hybrid", "conv", "state", "experts", "latent", "shared")


def variants() -> list[tuple[str, str, str | None]]:
    """(model, cache mode, --kv-dtype or None: the compute dtype)."""
    caches = [(m, None) for m in CACHE_MODES] + [(m, d) for m in STORAGE_MODES for d in KV_DTYPES]
    return [(model, *cache) for model in MODELS for cache in caches]


def refusal(model: str, mode: str, kv_dtype: str | None, feature: str) -> str | None:
    """Why `feature` is refused on this variant (a part of the error's message), or None:
    it composes."""
    if feature not in FEATURES:
        raise ValueError(f"unknown feature {feature!r}")
    if model == "latent" and mode == "window":  # refused as the cache is made
        return KEYS_UNROTATED
    if model == "shared" and mode in OWN_GEOMETRY_REFUSED:  # refused as the cache is made
        return ONE_GEOMETRY
    if mode == "off" and feature in ("save/load", "rollback"):
        return "keeps no cache" if feature == "save/load" else "cannot roll back"
    if feature == "speculative decoding" and mode in NO_SPECULATION:
        return NO_SPECULATION[mode]
    if model == "latent" and feature == "fused low-bit step":  # the layer, whatever the cache
        return f"torch step: {fused.mixer_why_not('latent')}"
    if model == "shared" and feature == "fused low-bit step":  # the layers, whatever the cache
        return f"torch step: {fused.OWN_HEADS}"
    if feature == "fused low-bit step" and mode not in FUSED_MODES:
        return f"torch step: {fused.NOT_THIS_CACHE}"
    if model == "state" and feature == "rollback":  # but to a state it kept (a draft's)
        return NO_ROLLBACK
    return None


def label(model: str, mode: str, kv_dtype: str | None) -> str:
    cache = mode if kv_dtype is None else f"{mode}, --kv-dtype {kv_dtype}"
    return cache if model == "llama" else f"{model}: {cache}"


def markdown() -> str:
    names = list(FEATURES)
    rows = (" | ".join([label(*v), *(_cell(refusal(*v, f)) for f in names)]) for v in variants())
    return "\n".join(table(" | ".join(["cache", *names]), "l" + "c" * len(names), rows)) + "\n"


def _cell(why: str | None) -> str:
    if why is None:
        return "yes"
    # the fused step is not asked for: where it does not run, nothing refuses
    return why if why.startswith("torch step") else f"refused: {why}"


if __name__ == "__main__":
    print(markdown(), end="")
