"""What every family reads alike: the sizes, RoPE and special tokens of a Hugging Face
`config.json` (`hf_config`) and of GGUF metadata (`gguf_config`), every value checked
by kvlm.config's `Fields` and `value` (a ModelLoadError naming the file, the key, what it
holds and what was expected). A family file calls them with its own part: the fields of
its block and the keys only it has, read at the point the reading reaches them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kvlm.config import (
    EXPERTS,
    LIMITS,
    REQUIRED,
    Experts,
    Fields,
    ModelConfig,
    RopeScaling,
    limits,
    shown,
    value,
)
from kvlm.errors import ModelLoadError, UnsupportedModelError

# (the config, its Fields, the architecture, hidden_size, num_heads) -> ModelConfig fields
HFPart = Callable[[dict[str, Any], Fields, str, int, int], dict[str, Any]]
# (the metadata's Fields, the architecture, num_layers, hidden_size, num_heads, head_dim)
# -> ModelConfig fields
GGUFPart = Callable[[Fields, str, int, int, int, int], dict[str, Any]]


def hf_config(
    cfg: dict[str, Any], arch: str, name: str, part: HFPart, rope_theta: float = 1e4,
    tied: bool = False,
) -> ModelConfig:  # fmt: skip
    """A ModelConfig from a config.json: the sizes, RoPE (`rope_theta` where the file
    names none), `tie_word_embeddings` (`tied` where absent), the special tokens, and
    what the family's `part` reads after the hidden size and the heads."""
    hf = Fields(cfg, f"{name}: config.json" if name else "config.json")
    hidden = hf("hidden_size", int, **limits("hidden_size"))
    heads = hf("num_attention_heads", int, **limits("num_heads"))
    own = part(cfg, hf, arch, hidden, heads)
    theta = hf_rope(cfg).get("rope_theta", rope_theta)
    context = hf("max_position_embeddings", int, 4096, **limits("max_position_embeddings"))
    scaling = hf_rope_scaling(cfg, hf)
    return ModelConfig(
        architecture=arch,
        vocab_size=hf("vocab_size", int, **limits("vocab_size")),
        hidden_size=hidden,
        intermediate_size=hf("intermediate_size", int, **limits("intermediate_size")),
        num_layers=hf("num_hidden_layers", int, **limits("num_layers")),
        num_heads=heads,
        num_kv_heads=hf("num_key_value_heads", int, None, **limits("num_kv_heads")) or heads,
        head_dim=hf("head_dim", int, None, **limits("head_dim")) or hidden // heads,
        rms_norm_eps=hf("rms_norm_eps", float, 1e-6, lo=0.0),
        rope_theta=value(theta, "rope_theta", float, 0.0, where=hf.where, open_low=True),
        max_position_embeddings=scaled_context(context, scaling),
        tie_word_embeddings=hf("tie_word_embeddings", bool, tied),
        rope_scaling=scaling,
        bos_token_id=hf("bos_token_id", int, None),
        eos_token_ids=as_ids(cfg.get("eos_token_id"), "eos_token_id", hf.where),
        name=name,
        **own,
    )


def hf_layer_mixers(types: Any, kinds: dict[str, str], hf: Fields, layers: int) -> tuple[str, ...]:
    """Each layer's mixer from a config's `layer_types` (`kinds`: a type's name -> its
    mixer), checked: a list of `layers` names, each one of `kinds`."""
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ModelLoadError(f"{hf.where}: layer_types is {shown(types)}; expected a list of "
                             "layer type names")  # fmt: skip
    if len(types) != layers:
        raise ModelLoadError(f"{hf.where}: layer_types names {len(types)} layers; "
                             f"num_hidden_layers is {layers}")  # fmt: skip
    unknown = sorted(set(types) - set(kinds))
    if unknown:
        raise UnsupportedModelError(f"{hf.where}: unsupported layer types {unknown} "
                                    f"(supported: {', '.join(kinds)})")  # fmt: skip
    return tuple(kinds[t] for t in types)


def hf_expert_counts(cfg: dict[str, Any], hf: Fields) -> tuple[int, int]:
    """A mixture of experts' experts a layer and those a token runs: `num_experts` (the
    Hub's configs; transformers 5 saves `num_local_experts`, its attribute_map's name),
    `num_experts_per_tok` (1 to the experts)."""
    key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    count = hf(key, int, lo=EXPERTS[0], hi=EXPERTS[1])
    return count, hf("num_experts_per_tok", int, lo=1, hi=count)


def gguf_expert_counts(g: Fields, arch: str) -> tuple[int, int]:
    """The same from llama.cpp's `{arch}.expert_count` and `{arch}.expert_used_count`."""
    count = g(f"{arch}.expert_count", int, lo=EXPERTS[0], hi=EXPERTS[1])
    return count, g(f"{arch}.expert_used_count", int, lo=1, hi=count)


def hf_window(hf: Fields) -> int | None:
    """The config's `sliding_window` (None where it has none)."""
    return hf("sliding_window", int, None, **limits("sliding_window"))


def gguf_config(
    g: Fields, arch: str, name: str, part: GGUFPart, partial_rope: bool = False
) -> ModelConfig:
    """A ModelConfig from GGUF metadata (`{arch}.*` keys as llama.cpp's converter writes
    them): the sizes, RoPE (`partial_rope`: the family rotates the first
    `rope.dimension_count` dimensions of each head, `rope_dim`; else that key, where
    present, must be the whole head), the special tokens, and what the family's `part`
    reads after the sizes. The model's layers are `block_count` less
    `nextn_predict_layers` (the blocks llama.cpp's converter appends for a
    multi-token-prediction head: `mtp_layers`, kvlm.model.mtp). Embeddings are untied
    here: the loader decides from the tensor list."""

    def key(k: str, kind: type, default: Any = REQUIRED, field_name: str = "") -> Any:
        """`{arch}.k`, in its field's LIMITS (a float: above 0)."""
        bounds = limits(field_name) if field_name else {"lo": 0.0} if kind is float else {}
        return g(f"{arch}.{k}", kind, default, **bounds)

    hidden = key("embedding_length", int, field_name="hidden_size")
    heads = key("attention.head_count", int, field_name="num_heads")
    context = key("context_length", int, 4096, "max_position_embeddings")
    scaling = gguf_rope_scaling(key, context)
    blocks = key("block_count", int, field_name="num_layers")
    extra = g(f"{arch}.nextn_predict_layers", int, 0, lo=0, hi=blocks - 1)
    layers = blocks - extra
    head_dim = key("attention.key_length", int, None, "head_dim")
    if head_dim is None:
        derived = f"head_dim ({arch}.embedding_length / {arch}.attention.head_count)"
        head_dim = value(hidden // heads, derived, int, *LIMITS["head_dim"], g.where)
    rotated = key("rope.dimension_count", int, None)
    if rotated is not None and rotated != head_dim and not partial_rope:
        raise UnsupportedModelError(f"{g.where}: {arch}.rope.dimension_count is {rotated}: "
                                    f"kvlm rotates whole heads ({head_dim})")  # fmt: skip
    own = part(g, arch, layers, hidden, heads, head_dim)
    if partial_rope and rotated is not None and rotated != head_dim:
        if rotated < 2 or rotated > head_dim or rotated % 2:
            raise UnsupportedModelError(f"{g.where}: {arch}.rope.dimension_count is {rotated}; "
                                        f"RoPE rotates an even number of a head's {head_dim} "
                                        "dimensions, 2 or more")  # fmt: skip
        own["rope_dim"] = rotated
    eos = g.data.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=gguf_vocab(g, arch),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length", int, field_name="intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", int, None, "num_kv_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", float, 1e-5),
        rope_theta=key("rope.freq_base", float, 10000.0),
        max_position_embeddings=scaled_context(context, scaling),
        tie_word_embeddings=False,  # decided by the loader from the tensor list
        rope_scaling=scaling,
        bos_token_id=g("tokenizer.ggml.bos_token_id", int, None),
        eos_token_ids=as_ids(eos, "tokenizer.ggml.eos_token_id", g.where),
        name=name,
        **{"mtp_layers": extra, **own},
    )


def gguf_experts(g: Fields, arch: str, **more: Any) -> Experts:
    """A mixture's sizes from `{arch}.expert_count`, `.expert_used_count` and
    `.expert_feed_forward_length` (llama.cpp's converter's keys), with the family's `more`
    (its router, its renormalisation: what its graph hard-codes)."""
    count, top_k = gguf_expert_counts(g, arch)
    return Experts(
        count=count,
        top_k=top_k,
        intermediate=g(f"{arch}.expert_feed_forward_length", int, **limits("intermediate_size")),
        **more,
    )


def gguf_kv_pattern(g: Fields, arch: str, other: str) -> tuple[Fields, tuple[str, ...] | None]:
    """The layer pattern of `{arch}.attention.head_count_kv` where it is an array (0: a
    layer of mixer `other`, one that does not attend: a short convolution, a Mamba2 layer,
    as llama.cpp reads it), and the metadata with that key the attention layers' one KV
    head count (every family's reader takes a number there)."""
    key = f"{arch}.attention.head_count_kv"
    counts = g.data.get(key)
    if not isinstance(counts, list):
        return g, None
    hi = LIMITS["num_kv_heads"][1]
    counts = [value(n, f"an entry of {key}", int, 0, hi, where=g.where) for n in counts]
    heads = sorted({n for n in counts if n})
    if len(heads) > 1:
        raise UnsupportedModelError(f"{g.where}: {key} gives attention layers different KV "
                                    f"head counts {heads}")  # fmt: skip
    data = {k: v for k, v in g.data.items() if k != key}
    if heads:  # none: a model without attention, its KV head count the query heads'
        data[key] = heads[0]
    return Fields(data, g.where), tuple(other if n == 0 else "attention" for n in counts)


def gguf_rope_scaling(key: Any, context: int) -> RopeScaling:
    """A GGUF file's `rope.scaling.*` keys, as llama.cpp's converter writes them (linear:
    the factor; YaRN: the factor, the original context, llama.cpp's beta_fast/slow keys
    where present)."""
    scaling_type = key("rope.scaling.type", str, None)
    if scaling_type in (None, "none"):
        return RopeScaling()
    if scaling_type == "linear":
        return RopeScaling("linear", key("rope.scaling.factor", float))
    if scaling_type == "yarn":
        original = key("rope.scaling.original_context_length", int, context,
                       "max_position_embeddings")  # fmt: skip
        return RopeScaling(
            "yarn", key("rope.scaling.factor", float), original_max_position_embeddings=original,
            beta_fast=key("rope.scaling.yarn_beta_fast", float, 32.0),
            beta_slow=key("rope.scaling.yarn_beta_slow", float, 1.0),
        )  # fmt: skip
    raise UnsupportedModelError(f"unsupported GGUF RoPE scaling {scaling_type!r}")


def gguf_vocab(g: Fields, arch: str) -> int:
    """The vocabulary's size: `{arch}.vocab_size`, else the token list's length; never fewer
    than the token list's tokens."""
    tokens = g.data.get("tokenizer.ggml.tokens")
    n = len(tokens) if isinstance(tokens, list) else 0
    size = g(f"{arch}.vocab_size", int, None, **limits("vocab_size"))
    if size is None and not n:
        raise ModelLoadError(f"{g.where} has no tokenizer.ggml.tokens")
    if size is not None and size < n:
        raise ModelLoadError(f"{g.where}: {arch}.vocab_size is {size}, fewer than the "
                             f"{n} tokens of tokenizer.ggml.tokens")  # fmt: skip
    return n if size is None else size


def as_ids(ids: Any, key: str, where: str) -> tuple[int, ...]:
    """A special token id, or a list of them, as a tuple (each an integer, 0 or more)."""
    if ids is None:
        return ()
    many = ids if isinstance(ids, list | tuple) else [ids]
    return tuple(value(i, key, int, 0, where=where) for i in many)


def hf_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers>=5 writes `rope_parameters` (per layer type where the layers' differ:
    the global layers' here); older configs use rope_theta/rope_scaling."""
    params = dict(cfg.get("rope_scaling") or {})
    given = cfg.get("rope_parameters") or {}
    params.update(given.get("full_attention", given))
    if "rope_theta" in cfg:
        params.setdefault("rope_theta", cfg["rope_theta"])
    return params


def hf_rope_scaling(cfg: dict[str, Any], hf: Fields) -> RopeScaling:
    params = hf_rope(cfg)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return RopeScaling()
    p = Fields(params, f"{hf.where} rope_scaling")
    context = hf("max_position_embeddings", int, 8192)
    most = LIMITS["max_position_embeddings"][1]
    # a top-level original_max_position_embeddings wins (Phi 3's), as transformers reads it
    original = hf("original_max_position_embeddings", int, None, lo=1, hi=most)
    original = original or p("original_max_position_embeddings", int, context, lo=1, hi=most)
    factor = p("factor", float, None, lo=0.0)
    if factor is None:  # YaRN without one: the ratio of the two lengths (DeepSeek's)
        factor = context / original if rope_type == "yarn" else 1.0
    return RopeScaling(
        rope_type=value(rope_type, "rope_type", str, where=hf.where),
        factor=factor,
        low_freq_factor=p("low_freq_factor", float, 1.0, lo=0.0),
        high_freq_factor=p("high_freq_factor", float, 4.0, lo=0.0),
        original_max_position_embeddings=original,
        beta_fast=p("beta_fast", float, None) or 32.0,  # 0 or absent: 32, as transformers
        beta_slow=p("beta_slow", float, None) or 1.0,
        attention_factor=p("attention_factor", float, None, lo=0.0),
        mscale=p("mscale", float, None),
        mscale_all_dim=p("mscale_all_dim", float, None),
        truncate=p("truncate", bool, True),
    )


def scaled_context(context: int, scaling: RopeScaling) -> int:
    """The model's context limit: its file's, or the length a YaRN scaling stretches its
    original one to where that is longer (Qwen's configs add YaRN by factor 4 over 32,768
    tokens and keep max_position_embeddings at 32,768)."""
    if scaling.rope_type != "yarn":
        return context
    stretched = math.floor(scaling.original_max_position_embeddings * scaling.factor)
    return min(max(context, stretched), LIMITS["max_position_embeddings"][1])
