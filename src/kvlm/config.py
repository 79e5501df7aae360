"""ModelConfig: the few numbers the transformer and the cache need, from either format.

Both constructors normalise to one vocabulary so nothing downstream knows whether a
model came from a Hugging Face `config.json` or from GGUF metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from kvlm.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError

# model_type (HF) / general.architecture (GGUF) -> what the model code switches on.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# What a user may ask RoPE to be scaled by for a context (--rope-scaling, LLM(rope_scaling=)):
# none, as the file gives it; linear or YaRN in place of the file's (for_context)
ROPE_SCALINGS = ("none", "linear", "yarn")
# HF model_type values read as one of the above (Gemma3ForCausalLM's text config)
HF_MODEL_TYPES = {"gemma3_text": "gemma3"}
# Gemma (as llama.cpp reads its GGUF files, which do not store these): every second (Gemma
# 2) or sixth (Gemma 3) layer attends to the whole context, the others to a window; Gemma
# 3's local layers' RoPE base.
GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA3_LOCAL_THETA = 10000.0
# Gemma 2 27B and Gemma 3 27B (by layer count): scores scaled by (hidden / heads) ** -0.5,
# not head_dim ** -0.5 (llama.cpp's rule for GGUF files)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA2_SOFTCAPS = {"final": 30.0, "attn": 50.0}
# The range of each size, past any real model's and short of what a buffer sized from it
# could not hold: a file outside one is refused before anything is sized from it (the
# tensors' shapes are then held to the sizes: kvlm.loading.shapes).
LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "num_layers": (1, 1 << 12),
    "num_heads": (1, 1 << 12),
    "num_kv_heads": (1, 1 << 12),
    "head_dim": (2, 1 << 12),
    "max_position_embeddings": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
}
_REQUIRED = object()  # a Fields call without a default: the key must be there


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """RoPE frequency scaling, with the numbers of transformers' ROPE_INIT_FUNCTIONS
    (kvlm.model.layers.rope_inv_freq computes them): `default` plain `theta ** (-2i/d)`
    frequencies; `linear` each divided by `factor`; `llama3` Llama 3.1's stretch by band
    (`low_freq_factor`, `high_freq_factor`); `yarn` (YaRN, Peng et al. 2023) the fast
    dimensions kept, those turning fewer than `beta_slow` times over
    `original_max_position_embeddings` divided by `factor`, a ramp between (from
    `beta_fast` turns), and cos/sin times `attention_scaling`."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # YaRN's scale of cos/sin; None: from `factor` (and mscale / mscale_all_dim where the
    # config names both: DeepSeek's), as transformers infers it
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True  # YaRN's ramp ends rounded to whole dimensions

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by: 1 but for YaRN (0.1 ln(factor) + 1)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool = False
    # the attention window of every layer (Mistral); with `layer_windows`, of none
    sliding_window: int | None = None
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # Per layer: its attention window, None for a layer that sees the whole context (Gemma
    # 3's local and global layers). Empty: every layer has `sliding_window`.
    layer_windows: tuple[int | None, ...] = ()
    # RoPE base of the layers with a window, where it is not rope_theta (Gemma 3: 10,000
    # locally, 1,000,000 globally; the global layers alone take `rope_scaling`)
    rope_local_theta: float | None = None
    # attention's score scale, where it is not head_dim ** -0.5 (query_pre_attn_scalar)
    query_scale: float | None = None
    # tanh soft-capping of the final logits (cap * tanh(logits / cap)) and of the attention
    # scores (Gemma 2)
    final_softcap: float | None = None
    attn_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        _check_supported("architecture", self.architecture, SUPPORTED_ARCHITECTURES)
        for name, (lo, hi) in LIMITS.items():
            n = getattr(self, name)
            if not (n is None and name == "sliding_window"):
                value(n, name, int, lo, hi, where=self.name)
        floats = [("rms_norm_eps", self.rms_norm_eps, 1.0), ("rope_theta", self.rope_theta, None),
                  ("rope_local_theta", self.rope_local_theta, None),
                  ("query_scale", self.query_scale, None),
                  ("RoPE scaling factor", self.rope_scaling.factor, None)]  # fmt: skip
        for name, x, hi in floats:
            if x is not None:
                value(x, name, float, 0.0, hi, where=self.name, open_low=True)
        ids = [("bos_token_id", self.bos_token_id)] + [
            ("eos_token_id", t) for t in self.eos_token_ids
        ]
        for key, t in ids:
            if t is not None:
                value(t, key, int, 0, self.vocab_size - 1, where=self.name)
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for RoPE")
        _check_supported("RoPE scaling", self.rope_scaling.rope_type, SUPPORTED_ROPE_TYPES)
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise UnsupportedModelError(
                f"{len(self.layer_windows)} layer types for {self.num_layers} layers"
            )
        for name in ("final_softcap", "attn_softcap"):
            cap = getattr(self, name)
            if cap is not None and not 0 < cap < math.inf:  # cap * tanh(x / cap)
                raise UnsupportedModelError(f"{name} {cap!r}: a soft-cap must be positive")

    @property
    def gemma(self) -> bool:
        """Gemma's block: embeddings scaled by sqrt(hidden), norms around attention and
        the MLP (before and after each), GeGLU, norm weights 1 + w (Gemma 3: q/k norms)."""
        return self.architecture in GEMMA_PATTERN

    @property
    def hybrid(self) -> bool:
        """Layers with a window and layers without (Gemma 3)."""
        return len(set(self.layer_windows)) > 1

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token occupies across all layers (times itemsize = bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (Llama, Mistral, Qwen2, Qwen3)."""
        if isinstance(cfg.get("text_config"), dict):  # a multimodal checkpoint: its text model
            cfg = _text_part(cfg)
        arch = str(cfg.get("model_type", "")).lower()
        arch = HF_MODEL_TYPES.get(arch, arch)
        if arch not in SUPPORTED_ARCHITECTURES:  # named as the config names its class
            shown = (cfg.get("architectures") or [arch or "?"])[0]
            _check_supported("architecture", arch, SUPPORTED_ARCHITECTURES, shown, "model_type")
        try:
            return cls._from_hf(cfg, arch, name)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a shape not read
            raise ModelLoadError(f"{name or 'config.json'}: a bad field: {exc!r}") from exc

    @classmethod
    def _from_hf(cls, cfg: dict[str, Any], arch: str, name: str) -> ModelConfig:
        hf = Fields(cfg, f"{name}: config.json" if name else "config.json")
        hidden = hf("hidden_size", int, **_limits("hidden_size"))
        heads = hf("num_attention_heads", int, **_limits("num_heads"))
        window = None  # Qwen2's is read only where it is used (configs name one they do not)
        if arch != "qwen2" or cfg.get("use_sliding_window", False):
            window = hf("sliding_window", int, None, **_limits("sliding_window"))
        extra = _hf_gemma(cfg, window, arch, hf) if arch in GEMMA_PATTERN else {}
        window = None if extra else window  # Gemma: the window is its local layers'
        theta = _hf_rope(cfg).get("rope_theta", 1e6 if arch == "gemma3" else 1e4)
        context = hf("max_position_embeddings", int, 4096, **_limits("max_position_embeddings"))
        scaling = _hf_rope_scaling(cfg, hf)
        return cls(
            architecture=arch,
            vocab_size=hf("vocab_size", int, **_limits("vocab_size")),
            hidden_size=hidden,
            intermediate_size=hf("intermediate_size", int, **_limits("intermediate_size")),
            num_layers=hf("num_hidden_layers", int, **_limits("num_layers")),
            num_heads=heads,
            num_kv_heads=hf("num_key_value_heads", int, None, **_limits("num_kv_heads")) or heads,
            head_dim=hf("head_dim", int, None, **_limits("head_dim")) or hidden // heads,
            rms_norm_eps=hf("rms_norm_eps", float, 1e-6, lo=0.0),
            rope_theta=value(theta, "rope_theta", float, 0.0, where=hf.where, open_low=True),
            max_position_embeddings=_scaled_context(context, scaling),
            tie_word_embeddings=hf("tie_word_embeddings", bool, arch in GEMMA_PATTERN),
            qk_norm=arch in ("qwen3", "gemma3"),
            sliding_window=window or None,
            rope_scaling=scaling,
            bos_token_id=hf("bos_token_id", int, None),
            eos_token_ids=_as_ids(cfg.get("eos_token_id"), "eos_token_id", hf.where),
            name=name,
            **extra,
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], name: str = "") -> ModelConfig:
        """Build from GGUF key/value metadata (`general.architecture` = llama/qwen2/qwen3/
        mistral/gemma2/gemma3). Every value is checked for its type and range
        (ModelLoadError naming the file, the key, what it holds and what was expected)."""
        g = Fields(meta, name or "GGUF metadata")
        arch = g("general.architecture", str, "")
        _check_supported("GGUF architecture", arch, SUPPORTED_ARCHITECTURES)

        def key(k: str, kind: type, default: Any = _REQUIRED, field_name: str = "") -> Any:
            """`{arch}.k`, in its field's LIMITS (a float: above 0)."""
            limits = _limits(field_name) if field_name else {"lo": 0.0} if kind is float else {}
            return g(f"{arch}.{k}", kind, default, **limits)

        hidden = key("embedding_length", int, field_name="hidden_size")
        heads = key("attention.head_count", int, field_name="num_heads")
        context = key("context_length", int, 4096, "max_position_embeddings")
        scaling = _gguf_rope_scaling(key, context)
        layers = key("block_count", int, field_name="num_layers")
        head_dim = key("attention.key_length", int, None, "head_dim")
        if head_dim is None:
            derived = f"head_dim ({arch}.embedding_length / {arch}.attention.head_count)"
            head_dim = value(hidden // heads, derived, int, *LIMITS["head_dim"], g.where)
        rotated = key("rope.dimension_count", int, None)
        if rotated is not None and rotated != head_dim:
            raise UnsupportedModelError(f"{g.where}: {arch}.rope.dimension_count is {rotated}: "
                                        f"kvlm rotates whole heads ({head_dim})")  # fmt: skip
        gemma = _gguf_gemma(g, arch, layers, hidden, heads, head_dim)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=_gguf_vocab(g, arch),
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length", int, field_name="intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=key("attention.head_count_kv", int, None, "num_kv_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", float, 1e-5),
            rope_theta=key("rope.freq_base", float, 10000.0),
            max_position_embeddings=_scaled_context(context, scaling),
            tie_word_embeddings=False,  # decided by the loader from the tensor list
            qk_norm=arch in ("qwen3", "gemma3"),
            rope_scaling=scaling,
            bos_token_id=g("tokenizer.ggml.bos_token_id", int, None),
            eos_token_ids=_as_ids(eos, "tokenizer.ggml.eos_token_id", g.where),
            name=name,
            **gemma,
        )


def for_context(
    config: ModelConfig, max_context: int, scaling: str | None = None,
    factor: float | None = None, bounded: bool = False,
) -> tuple[ModelConfig, str | None]:  # fmt: skip
    """The config whose RoPE serves `max_context` tokens a sequence, and the warning for a
    context past the trained one (None within it).

    `scaling` None: the file's own RoPE; past the trained length, for a file that scales
    none, YaRN by max_context / trained. (llama.cpp keeps RoPE as trained there and warns:
    the slow dimensions then turn to angles the model never saw. YaRN keeps the fast ones,
    those of short distances, as trained and interpolates only the slow ones.) "none": the
    file's RoPE whatever the context, as llama.cpp runs it. "linear", "yarn": that scaling
    by `factor` (default: max_context / the original length, at least 1), over the trained
    length (a YaRN file's original one), in place of the file's: only where the file scales
    none or by YaRN (llama3's and linear frequencies are the ones its model learned).
    `bounded`: the cache keeps RoPE positions within the trained length itself (the window
    cache counting them inside it): nothing to scale, nothing to say."""
    trained, own = config.max_position_embeddings, config.rope_scaling
    if scaling is not None and scaling not in ROPE_SCALINGS:
        raise InvalidRequestError(
            f"unknown RoPE scaling {scaling!r}; valid: {', '.join(ROPE_SCALINGS)}",
            param="rope_scaling",
        )
    if factor is not None:
        if scaling not in ("linear", "yarn"):
            raise InvalidRequestError("a RoPE scale needs the RoPE scaling linear or yarn",
                                      param="rope_scale")  # fmt: skip
        if not isinstance(factor, int | float) or not 1 <= factor < math.inf:
            raise InvalidRequestError(f"the RoPE scale must be a number >= 1, got {factor!r}",
                                      param="rope_scale")  # fmt: skip
    if scaling in ("linear", "yarn"):
        if own.rope_type not in ("default", "yarn"):
            raise InvalidRequestError(
                f"the model's file scales RoPE by {own.rope_type} (factor {own.factor:g}), "
                "the frequencies it was trained on: linear or YaRN would replace them",
                param="rope_scaling",
            )
        original = own.original_max_position_embeddings if own.rope_type == "yarn" else trained
        chosen = RopeScaling(scaling, float(factor or max(1.0, max_context / original)),
                             original_max_position_embeddings=original)  # fmt: skip
        config = replace(config, rope_scaling=chosen)
    elif scaling is None and max_context > trained and own.rope_type == "default" and not bounded:
        chosen = RopeScaling("yarn", max_context / trained,
                             original_max_position_embeddings=trained)  # fmt: skip
        config = replace(config, rope_scaling=chosen)
    if max_context <= trained or bounded:
        return config, None
    auto = scaling is None and own.rope_type == "default"
    return config, _past_trained(config, max_context, trained, auto)


def _past_trained(config: ModelConfig, n: int, trained: int, chosen_for_you: bool) -> str:
    """The one line a context past the trained one is said in (`chosen_for_you`: the YaRN
    for_context picked)."""
    s = config.rope_scaling
    said = f"--max-context {n} is past the model's trained context of {trained} tokens: "
    if s.rope_type not in ("linear", "yarn"):
        kept = "unscaled" if s.rope_type == "default" else f"as the file scales it ({s.rope_type})"
        return said + (f"RoPE {kept}, at positions the model never saw (--rope-scaling yarn "
                       "interpolates them)")  # fmt: skip
    name = "YaRN" if s.rope_type == "yarn" else "linear interpolation"
    said += f"RoPE scaled by {name}, factor {s.factor:g}"
    covered = math.floor(s.original_max_position_embeddings * s.factor)
    if covered < n:
        said += f", which stretches it to {covered} tokens"
    if chosen_for_you:
        said += " (--rope-scaling none: unscaled, as llama.cpp runs it)"
    return said


def value(
    x: Any, key: str, kind: type, lo: float | None = None, hi: float | None = None,
    where: str = "", open_low: bool = False,
) -> Any:  # fmt: skip
    """`x` if it is a `kind` (int: an integer, not a bool; float: a finite number, an
    integer too, given as a float; str; bool) within [lo, hi] (lo excluded with
    `open_low`), else a ModelLoadError naming `where` (the file), the key, what it holds
    and what was expected."""
    ok = isinstance(x, kind) and not (kind is int and isinstance(x, bool))
    if kind is float and isinstance(x, int) and not isinstance(x, bool):
        x, ok = float(x), True
    if ok and kind is float and not math.isfinite(x):
        ok = False
    if ok and kind in (int, float):
        ok = (lo is None or (x > lo if open_low else x >= lo)) and (hi is None or x <= hi)
    if ok:
        return x
    what = {int: "an integer", float: "a finite number", str: "a string", bool: "a boolean"}
    expected = what[kind]
    if kind in (int, float) and (lo is not None or hi is not None):
        low = "" if lo is None else f"{'above' if open_low else 'at least'} {lo:g}"
        high = "" if hi is None else f"at most {hi:g}"
        expected += " " + " and ".join(p for p in (low, high) if p)
    prefix = f"{where}: " if where else ""
    raise ModelLoadError(f"{prefix}{key} is {_shown(x)}; expected {expected}")


def _is_str(x: Any) -> bool:
    return isinstance(x, str)


def _limits(field_name: str) -> dict[str, int]:
    """A field's LIMITS as a reader's lo= and hi=."""
    lo, hi = LIMITS[field_name]
    return {"lo": lo, "hi": hi}


def _shown(x: Any) -> str:
    """A value as an error message shows it: its type where that is the fault, short."""
    if isinstance(x, list):
        return f"an array of {len(x)}"
    if isinstance(x, str):
        return f"a string {x[:40]!r}" + ("..." if len(x) > 40 else "")
    if isinstance(x, bool):
        return f"a boolean {x}"
    if isinstance(x, dict):
        return "an object"
    return repr(x)


class Fields:
    """Typed values of a mapping (GGUF metadata, a config.json), each checked by `value`:
    `fields(key, kind, default, lo=, hi=)` (no default: the key must be there; an int is
    0 or more unless `lo` says otherwise; a float's `lo` is excluded); `where` names the
    file in errors."""

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.data, self.where = data, where

    def __call__(
        self, key: str, kind: type, default: Any = _REQUIRED, lo: float | None = None,
        hi: float | None = None,
    ) -> Any:  # fmt: skip
        x = self.data.get(key)
        if x is None:
            if default is _REQUIRED:
                raise UnsupportedModelError(f"{self.where} lacks {key}")
            return default
        if kind is int and lo is None:
            lo = 0
        return value(x, key, kind, lo, hi, self.where, open_low=kind is float and lo is not None)


def _gguf_rope_scaling(key: Any, context: int) -> RopeScaling:
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


def _gguf_vocab(g: Fields, arch: str) -> int:
    """The vocabulary's size: `{arch}.vocab_size`, else the token list's length; never fewer
    than the token list's tokens."""
    tokens = g.data.get("tokenizer.ggml.tokens")
    n = len(tokens) if isinstance(tokens, list) else 0
    size = g(f"{arch}.vocab_size", int, None, **_limits("vocab_size"))
    if size is None and not n:
        raise ModelLoadError(f"{g.where} has no tokenizer.ggml.tokens")
    if size is not None and size < n:
        raise ModelLoadError(f"{g.where}: {arch}.vocab_size is {size}, fewer than the "
                             f"{n} tokens of tokenizer.ggml.tokens")  # fmt: skip
    return n if size is None else size


def _gguf_gemma(
    g: Fields, arch: str, layers: int, hidden: int, heads: int, head_dim: int
) -> dict[str, Any]:
    """Gemma's fields from its GGUF metadata (none for another architecture): the layer
    pattern, the score scale, the local layers' RoPE base, the soft-caps."""
    if arch not in GEMMA_PATTERN:
        return {}
    window = g(f"{arch}.attention.sliding_window", int, **_limits("sliding_window"))
    # the file's own pattern where it has one: every n-th layer global, or a flag per layer
    # (True: windowed); else llama.cpp's fixed one
    pattern = g.data.get(f"{arch}.attention.sliding_window_pattern", GEMMA_PATTERN[arch])
    types = None
    if isinstance(pattern, list):
        flags = [value(f, "a sliding_window_pattern entry", bool, where=g.where) for f in pattern]
        types = ["sliding_attention" if f else "full_attention" for f in flags]
        pattern = GEMMA_PATTERN[arch]
    pattern = value(pattern, f"{arch}.attention.sliding_window_pattern", int, 1, where=g.where)
    extra = _gemma_layers(layers, window, pattern, types)
    scalar = hidden // heads if layers == GEMMA_27B_LAYERS[arch] else head_dim
    extra["query_scale"] = _query_scale(scalar)
    if arch == "gemma3":
        extra["rope_local_theta"] = GEMMA3_LOCAL_THETA
    for field_name, k in (("final_softcap", "final"), ("attn_softcap", "attn")):
        extra[field_name] = g(f"{arch}.{k}_logit_softcapping", float, None, lo=0.0)
    return extra


def _text_part(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's language model (Gemma3ForConditionalGeneration: Gemma 3 4B
    and up on the Hub), with the top level's special tokens where the text part has none;
    kvlm runs text only (loading.hf reads the language model's weights)."""
    text = dict(cfg["text_config"])
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
        if key in cfg and key not in text:
            text[key] = cfg[key]
    return text


def _query_scale(scalar: float) -> float:
    """Attention's score scale from Gemma's query_pre_attn_scalar: scalar ** -0.5."""
    if not 0 < scalar < math.inf:
        raise UnsupportedModelError(f"query_pre_attn_scalar {scalar!r} must be positive")
    return scalar**-0.5


def _check_supported(
    what: str, value: str, supported: tuple[str, ...], shown: Any = None, among: str = ""
) -> None:
    """UnsupportedModelError naming `shown` (else `value`) unless `value` is `supported`."""
    if value not in supported:
        shown = value if shown is None else shown
        raise UnsupportedModelError(
            f"unsupported {what} {shown!r} (supported{among and ' ' + among}: "
            f"{', '.join(supported)})"
        )


def _as_ids(ids: Any, key: str, where: str) -> tuple[int, ...]:
    """A special token id, or a list of them, as a tuple (each an integer, 0 or more)."""
    if ids is None:
        return ()
    many = ids if isinstance(ids, list | tuple) else [ids]
    return tuple(value(i, key, int, 0, where=where) for i in many)


def _hf_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers>=5 writes `rope_parameters`; older configs use rope_theta/rope_scaling."""
    params = dict(cfg.get("rope_scaling") or {})
    given = cfg.get("rope_parameters") or {}
    params.update(given.get("full_attention", given))  # Gemma 3: per layer type
    if "rope_theta" in cfg:
        params.setdefault("rope_theta", cfg["rope_theta"])
    return params


def _hf_rope_scaling(cfg: dict[str, Any], hf: Fields) -> RopeScaling:
    params = _hf_rope(cfg)
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


def _scaled_context(context: int, scaling: RopeScaling) -> int:
    """The model's context limit: its file's, or the length a YaRN scaling stretches its
    original one to where that is longer (Qwen's configs add YaRN by factor 4 over 32,768
    tokens and keep max_position_embeddings at 32,768)."""
    if scaling.rope_type != "yarn":
        return context
    stretched = math.floor(scaling.original_max_position_embeddings * scaling.factor)
    return min(max(context, stretched), LIMITS["max_position_embeddings"][1])


def _gemma_layers(
    layers: int, window: int, pattern: int, types: list[str] | None
) -> dict[str, Any]:
    """`layer_windows` from HF's `layer_types` (else every `pattern`-th layer global)."""
    if window < 1 or pattern < 1:
        raise UnsupportedModelError(f"a sliding window of {window} every {pattern} layers")
    if types is None:
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]  # fmt: skip
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise UnsupportedModelError(f"unsupported layer types {sorted(unknown)}")
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    return {"layer_windows": windows}


def _hf_gemma(cfg: dict[str, Any], window: int | None, arch: str, hf: Fields) -> dict[str, Any]:
    """Gemma's fields from its HF text config: the layer pattern, Gemma 3's two RoPE bases
    (transformers 5's `rope_parameters` per layer type, or the Hub's `rope_theta`,
    `rope_local_base_freq` and `rope_scaling`), the score scale and the soft-caps."""
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention (an embedding model) is not supported")
    pattern = hf("sliding_window_pattern", int, GEMMA_PATTERN[arch], lo=1)
    layers = hf("num_hidden_layers", int)
    types = cfg.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(map(_is_str, types))):
        raise ModelLoadError(f"{hf.where}: layer_types is {_shown(types)}; expected a list of "
                             "layer type names")  # fmt: skip
    extra = _gemma_layers(layers, window or 4096, pattern, types)
    if arch == "gemma3":
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
        theta = local.get("rope_theta", cfg.get("rope_local_base_freq", GEMMA3_LOCAL_THETA))
        extra["rope_local_theta"] = value(theta, "rope_local_base_freq", float, 0.0,
                                          where=hf.where, open_low=True)  # fmt: skip
    extra["query_scale"] = _query_scale(hf("query_pre_attn_scalar", float, 256.0, lo=0.0))
    for field_name, k in (("final_softcap", "final"), ("attn_softcap", "attn")):
        # absent: transformers' defaults (Gemma 2: 30 and 50; Gemma 3: none)
        default = GEMMA2_SOFTCAPS[k] if arch == "gemma2" else None
        extra[field_name] = hf(f"{k}_logit_softcapping", float, default, lo=0.0)
    return extra
