"""ModelConfig: the few numbers the transformer and the cache need, from either format.

Both constructors normalise to one vocabulary so nothing downstream knows whether a
model came from a Hugging Face `config.json` or from GGUF metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvlm.errors import UnsupportedModelError

# model_type (HF) / general.architecture (GGUF) -> what the model code switches on.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
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


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `default` means plain `theta ** (-2i/d)` frequencies."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            window = cfg.get("sliding_window")
            if arch == "qwen2" and not cfg.get("use_sliding_window", False):
                window = None
            extra = _hf_gemma(cfg, window, arch) if arch in GEMMA_PATTERN else {}
            window = None if extra else window  # Gemma: the window is its local layers'
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_hf_rope(cfg).get("rope_theta", 1e6 if arch == "gemma3" else 1e4)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in GEMMA_PATTERN)),
                qk_norm=arch in ("qwen3", "gemma3"),
                sliding_window=int(window) if window else None,
                rope_scaling=_hf_rope_scaling(cfg),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_as_ids(cfg.get("eos_token_id")),
                name=name,
                **extra,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedModelError(
                f"config.json is missing or has a bad field: {exc}"
            ) from exc

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], name: str = "") -> ModelConfig:
        """Build from GGUF key/value metadata (`general.architecture` = llama/qwen2/qwen3)."""
        arch = str(meta.get("general.architecture", ""))
        _check_supported("GGUF architecture", arch, SUPPORTED_ARCHITECTURES)

        def key(k: str, default: Any = None) -> Any:
            v = meta.get(f"{arch}.{k}", default)
            if v is None:
                raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{k}")
            return v

        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
        scaling = RopeScaling()
        scaling_type = meta.get(f"{arch}.rope.scaling.type")
        if scaling_type == "linear":
            scaling = RopeScaling("linear", float(key("rope.scaling.factor")))
        elif scaling_type not in (None, "none"):
            raise UnsupportedModelError(f"unsupported GGUF RoPE scaling {scaling_type!r}")
        layers, head_dim = (
            int(key("block_count")),
            int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
        )
        extra: dict[str, Any] = {}
        if arch in GEMMA_PATTERN:
            window = int(key("attention.sliding_window"))
            # the file's own pattern where it has one: every n-th layer global, or a flag
            # per layer (True: windowed); else llama.cpp's fixed one
            pattern = meta.get(f"{arch}.attention.sliding_window_pattern", GEMMA_PATTERN[arch])
            types = None
            if isinstance(pattern, list):
                types = ["sliding_attention" if f else "full_attention" for f in pattern]
                pattern = GEMMA_PATTERN[arch]
            extra = _gemma_layers(layers, window, int(pattern), types)
            scalar = hidden // heads if layers == GEMMA_27B_LAYERS[arch] else head_dim
            extra["query_scale"] = _query_scale(scalar)
            if arch == "gemma3":
                extra["rope_local_theta"] = GEMMA3_LOCAL_THETA
            for field_name, k in (("final_softcap", "final"), ("attn_softcap", "attn")):
                cap = meta.get(f"{arch}.{k}_logit_softcapping")
                extra[field_name] = None if cap is None else float(cap)
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings=False,  # decided by the loader from the tensor list
            qk_norm=arch in ("qwen3", "gemma3"),
            rope_scaling=scaling,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_ids(meta.get("tokenizer.ggml.eos_token_id")),
            name=name,
            **extra,
        )


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


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)


def _hf_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers>=5 writes `rope_parameters`; older configs use rope_theta/rope_scaling."""
    params = dict(cfg.get("rope_scaling") or {})
    given = cfg.get("rope_parameters") or {}
    params.update(given.get("full_attention", given))  # Gemma 3: per layer type
    if "rope_theta" in cfg:
        params.setdefault("rope_theta", cfg["rope_theta"])
    return params


def _hf_rope_scaling(cfg: dict[str, Any]) -> RopeScaling:
    params = _hf_rope(cfg)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return RopeScaling()
    return RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


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


def _hf_gemma(cfg: dict[str, Any], window: Any, arch: str) -> dict[str, Any]:
    """Gemma's fields from its HF text config: the layer pattern, Gemma 3's two RoPE bases
    (transformers 5's `rope_parameters` per layer type, or the Hub's `rope_theta`,
    `rope_local_base_freq` and `rope_scaling`), the score scale and the soft-caps."""
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention (an embedding model) is not supported")
    pattern = int(cfg.get("sliding_window_pattern", GEMMA_PATTERN[arch]))
    layers = int(cfg["num_hidden_layers"])
    extra = _gemma_layers(layers, int(window or 4096), pattern, cfg.get("layer_types"))
    if arch == "gemma3":
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
        extra["rope_local_theta"] = float(
            local.get("rope_theta", cfg.get("rope_local_base_freq", GEMMA3_LOCAL_THETA))
        )
    extra["query_scale"] = _query_scale(float(cfg.get("query_pre_attn_scalar", 256)))
    for field_name, k in (("final_softcap", "final"), ("attn_softcap", "attn")):
        # absent: transformers' defaults (Gemma 2: 30 and 50; Gemma 3: none)
        cap = cfg.get(f"{k}_logit_softcapping", GEMMA2_SOFTCAPS[k] if arch == "gemma2" else None)
        extra[field_name] = None if cap is None else float(cap)
    return extra
