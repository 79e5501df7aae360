"""The registry of model families: a Hugging Face `model_type` or a GGUF
`general.architecture` -> its family file's `Family` (kvlm.arch.family), and the
ModelConfig that family reads from the file.

One module per family (llama.py: Llama, Mistral, Qwen2, Qwen3; gemma.py: Gemma 2 and 3;
gemma4.py: Gemma 4 (text);
lfm2.py: LFM2 and LFM2-MoE; qwen35.py: Qwen3.5; granite.py: Granite 4.0-H; qwen3moe.py:
Qwen3-MoE; gptoss.py: gpt-oss; olmoe.py: OLMoE; deepseek2.py: DeepSeek-V2, and on the
same layers DeepSeek-V3 and GLM-4.7-Flash), each imported family is a module and a line in
FAMILIES (docs/ADDING_A_MODEL.md). Outside kvlm.arch,
code reads the ModelConfig a family made and the `Family` fields (tensor names, folds,
tokenizer quirks), never a family's name.
"""

from __future__ import annotations

from typing import Any

from kvlm.arch import (
    deepseek2,
    gemma,
    gemma4,
    gptoss,
    granite,
    lfm2,
    llama,
    olmoe,
    qwen3moe,
    qwen35,
)
from kvlm.arch.family import Family, Shape, Tokenizing
from kvlm.config import Fields, ModelConfig, check_supported
from kvlm.errors import ModelLoadError

__all__ = ["FAMILIES", "SHAPES", "SUPPORTED_ARCHITECTURES", "Family", "Shape", "Tokenizing",
           "config_from_gguf", "config_from_hf", "family", "pre_tokenizer",
           "tokenizing"]  # fmt: skip

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    gemma.FAMILY,
    gemma4.FAMILY,
    lfm2.FAMILY,
    qwen35.FAMILY,
    granite.FAMILY,
    qwen3moe.FAMILY,
    gptoss.FAMILY,
    olmoe.FAMILY,
    deepseek2.FAMILY,
)
_BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
# ModelConfig.architecture values, each also a GGUF general.architecture
SUPPORTED_ARCHITECTURES = tuple(_BY_ARCHITECTURE)
# config.json's model_type -> the architecture
_HF_MODEL_TYPES = {t: a for f in FAMILIES for t, a in f.hf_model_types.items()}
# real models' sizes, by name (kvlm.bench.models writes random-weight files of them)
SHAPES: dict[str, Shape] = {n: s for f in FAMILIES for n, s in f.shapes.items()}
# a byte-level vocabulary's tokenizer.ggml.pre -> the llama.cpp pre-tokenizer it reads as
_PRE_TOKENIZERS = {n: t for f in FAMILIES for n, t in f.pre_tokenizers.items()}


def family(architecture: str) -> Family:
    """The family of a ModelConfig's architecture (UnsupportedModelError for none)."""
    check_supported("architecture", architecture, SUPPORTED_ARCHITECTURES)
    return _BY_ARCHITECTURE[architecture]


def config_from_hf(cfg: dict[str, Any], name: str = "") -> ModelConfig:
    """The ModelConfig of a Hugging Face `config.json` dict (a multimodal checkpoint's:
    its text model's), read by its family."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = _text_part(cfg)
    model_type = str(cfg.get("model_type", "")).lower()
    arch = _HF_MODEL_TYPES.get(model_type, model_type)
    if arch not in SUPPORTED_ARCHITECTURES:  # named as the config names its class
        shown = (cfg.get("architectures") or [arch or "?"])[0]
        check_supported("architecture", arch, SUPPORTED_ARCHITECTURES, shown, "model_type")
    try:
        return _BY_ARCHITECTURE[arch].from_hf(cfg, arch, name)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a shape not read
        raise ModelLoadError(f"{name or 'config.json'}: a bad field: {exc!r}") from exc


def config_from_gguf(meta: dict[str, Any], name: str = "") -> ModelConfig:
    """The ModelConfig of GGUF key/value metadata (`general.architecture` one of
    SUPPORTED_ARCHITECTURES), read by its family. Every value is checked for its type and
    range (ModelLoadError naming the file, the key, what it holds and what was expected)."""
    g = Fields(meta, name or "GGUF metadata")
    arch = g("general.architecture", str, "")
    check_supported("GGUF architecture", arch, SUPPORTED_ARCHITECTURES)
    return _BY_ARCHITECTURE[arch].from_gguf(g, arch, name)


def tokenizing(gguf_architecture: Any) -> Tokenizing:
    """How the SentencePiece vocabulary of a GGUF file of this `general.architecture`
    reads (kvlm.loading.tokenizer): its family's quirks, or none."""
    for f in FAMILIES:
        if gguf_architecture in f.vocabularies:
            return f.tokenizing
    return Tokenizing()


def pre_tokenizer(name: str) -> str:
    """The llama.cpp pre-tokenizer a GGUF vocabulary's `tokenizer.ggml.pre` reads as: a
    family's own name for one (LFM2's "lfm2" is Llama 3's), else the name itself."""
    return _PRE_TOKENIZERS.get(name, name)


def _text_part(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's language model (a vision tower beside it, `text_config`),
    with the top level's special tokens where the text part has none; kvlm runs text only
    (kvlm.loading.hf reads the language model's weights)."""
    text = dict(cfg["text_config"])
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
        if key in cfg and key not in text:
            text[key] = cfg[key]
    return text
