"""What a model family is to kvlm: one `Family` per family file of kvlm.arch, the
registry's entry for it.

A family reads its files' configs into a ModelConfig (the sizes and the block's
composition as plain data: kvlm.config), names its tensors in each format, folds its
weights' quirks into the weights at load (`fold_hf`, `gguf_rows`: what the model then
multiplies is what llama.cpp's converter would have stored, in Hugging Face's row
order), says how its GGUF vocabulary reads (`Tokenizing`) and which real models' shapes
benchmarks may build (`shapes`). Everything outside kvlm.arch reads the ModelConfig and
these fields, never a family's name.

The model's tensor names (`model.layers.3.self_attn.q_proj.weight`: the names the
transformer takes, kvlm.model.weights.WeightSource) are the Llama block's Hugging Face
names, and for a block that norms the attention's and the MLP's outputs too,
`attn_out_norm` and `mlp_out_norm`; a short convolution's are `conv.in_proj`,
`conv.conv`, `conv.out_proj`. llama.cpp names tensors by their role in every
family (`ffn_norm` is the MLP's input norm whatever else a block has), so one table
(`LAYER_NAMES`, `GLOBAL_NAMES`, `CONV_NAMES`) serves every family's GGUF files; a family
adds its own (`gguf_names`, `gguf_globals`). A GGUF tensor that has no `.weight` or
`.bias` of its own (`blk.0.ssm_a`), or whose suffix the model's name does not keep
(`blk.0.ssm_dt.bias`, the model's `linear_attn.dt_bias`), is named in `gguf_names`
whole: the GGUF name after `blk.N.` -> the model's after `model.layers.N.`. A Hugging
Face checkpoint whose names differ from the model's (a role named otherwise) says so in
`hf_names` (a key's `*` standing for an index: `experts.*.w1`, any expert's) and
`hf_globals`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlm.config import Fields, ModelConfig
from kvlm.errors import ModelLoadError

# llama.cpp's names (blk.N.<name>) -> the model's (model.layers.N.<name>)
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",  # the MLP's input norm (Llama's HF name)
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # a mixture of experts (kvlm.model.experts): the router, and every expert's gate, up
    # and down stacked (experts, rows, columns)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    # a sigmoid router's selection bias (experts,): named whole (the model's has no .bias)
    "exp_probs_b.bias": "mlp.expert_bias",
    # a shared expert beside them, and its gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# the output norms of a "sandwich" block (kvlm.config.NORM_LAYOUTS), as llama.cpp names them
OUT_NORM_NAMES = {"post_attention_norm": "attn_out_norm", "post_ffw_norm": "mlp_out_norm"}
# a short convolution's tensors (kvlm.config.MIXERS "conv", kvlm.model.conv), as llama.cpp
# names them: the model's names are transformers' (`conv.conv` the depthwise kernel)
CONV_NAMES = {
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.conv": "conv.conv",
    "shortconv.out_proj": "conv.out_proj",
}
# a multi-token-prediction head's own tensors, as llama.cpp's converter names them in the
# block it appends (blk.N.nextn.*) -> the model's, after `mtp.` (the checkpoints' names)
NEXTN_NAMES = {
    "nextn.eh_proj": "fc",
    "nextn.enorm": "pre_fc_norm_embedding",
    "nextn.hnorm": "pre_fc_norm_hidden",
    "nextn.shared_head_norm": "norm",
}
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "rope_freqs": "rope_freqs",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(\w+)")
_INDEX = re.compile(r"\.(\d+)\.")  # an index inside a layer tensor's name (an expert's)

# (the config, the model's name of a tensor, the tensor) -> the tensor the model takes
Fold = Callable[[ModelConfig, str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Tokenizing:
    """How a family's GGUF SentencePiece vocabulary reads (as transformers reads the
    family's own tokenizer): `spaces_as_pieces`, a token spelled in spaces is looked up
    as "▁"s; `merges_in_vocab_order`, pieces merge in the vocabulary's order, not by the
    stored scores."""

    spaces_as_pieces: bool = False
    merges_in_vocab_order: bool = False


@dataclass(frozen=True, slots=True)
class Shape:
    """A real model's sizes (its config.json on the Hub), for random-weight files of that
    shape (kvlm.bench.models): `arch` its GGUF general.architecture, `window` its layers'
    sliding window where it has one, `qkv_bias` whether its q|k|v products have biases,
    `llama3_rope` whether its file carries Llama 3.x's rope_freqs factors;
    `attention_layers` the layers that attend where the others mix by a short convolution
    of `conv_kernel` positions (None: every layer attends); `experts` the experts of every
    layer's FFN (0: a gated MLP); `biases` whether its attention projections (q, k, v and
    the output), its router and its experts have biases; `yarn` YaRN's (factor, original
    context) where its RoPE is stretched so."""

    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    tied: bool
    rope_theta: float
    context: int
    eps: float = 1e-6
    llama3_rope: bool = False
    window: int | None = None
    qkv_bias: bool = False
    attention_layers: tuple[int, ...] | None = None
    conv_kernel: int = 3
    # a mixture of experts in every layer: `experts` of `expert_inter` each, `experts_used`
    # a token (0: the gated MLP of `inter`)
    experts: int = 0
    experts_used: int = 0
    expert_inter: int = 0
    biases: bool = False
    yarn: tuple[float, int] | None = None


@dataclass(frozen=True, slots=True)
class Family:
    """One family file's entry in the registry (kvlm.arch).

    `architectures`: the ModelConfig.architecture values it covers, each also the GGUF
    `general.architecture` of its files; `hf_model_types`: config.json's `model_type` -> one
    of those; `from_hf(config.json's dict, architecture, name)` and `from_gguf(the
    metadata's Fields, architecture, name)`: its ModelConfig (kvlm.arch.readers);
    `gguf_names`: its GGUF files' layer tensors -> the model's names; `hf_names`: a
    checkpoint's layer tensors whose names are not the model's -> the model's (a role, or a
    name after `model.layers.N.` whole, as `gguf_names`); `gguf_globals`, `hf_globals`: the
    tensors outside the layers (their names without the `.weight`) -> the model's, in each
    format, where a family's differ; `fold_hf`: a Hugging Face tensor -> what the model
    multiplies (`hf_shape`: its shape then, where the fold changes it); `gguf_rows`: a GGUF
    tensor's rows in Hugging Face's order (the row order alone, so that low-bit blocks take
    it as they are packed); `gguf_cols`: its columns (the last dimension) in Hugging Face's
    order (low-bit blocks take it where it moves whole blocks, else the tensor is decoded);
    `fold_gguf`: a GGUF vector's values (decoded, in Hugging Face's order) -> what the model
    takes, where the converter changed them (a 1-D tensor's only: no low-bit kernel reads
    one); `vocabularies`: the GGUF architectures whose SentencePiece vocabulary reads by
    `tokenizing`; `pre_tokenizers`: a byte-level vocabulary's `tokenizer.ggml.pre` -> the
    llama.cpp pre-tokenizer it reads as (its files name their own); `shapes`: real models'
    sizes."""

    name: str
    architectures: tuple[str, ...]
    from_hf: Callable[[dict[str, Any], str, str], ModelConfig]
    from_gguf: Callable[[Fields, str, str], ModelConfig]
    hf_model_types: Mapping[str, str] = field(default_factory=dict)
    gguf_names: Mapping[str, str] = field(default_factory=lambda: LAYER_NAMES)
    hf_names: Mapping[str, str] = field(default_factory=dict)
    gguf_globals: Mapping[str, str] = field(default_factory=lambda: GLOBAL_NAMES)
    hf_globals: Mapping[str, str] = field(default_factory=dict)
    fold_hf: Fold | None = None
    # (the model's name, the stored shape) -> the shape `fold_hf` gives it, where a fold
    # changes it (a transposed stack): what the shape check holds to the config
    hf_shape: Callable[[str, tuple[int, ...]], tuple[int, ...]] | None = None
    gguf_rows: Fold | None = None
    gguf_cols: Fold | None = None
    fold_gguf: Fold | None = None
    tokenizing: Tokenizing = field(default_factory=Tokenizing)
    vocabularies: tuple[str, ...] = ()
    pre_tokenizers: Mapping[str, str] = field(default_factory=dict)
    shapes: Mapping[str, Shape] = field(default_factory=dict)

    def from_gguf_name(self, name: str, layers: int | None = None) -> str | None:
        """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None: a
        tensor the model does not read). Given the model's `layers`, a block past them is
        the multi-token-prediction head's (llama.cpp's converter appends its blocks): its
        own tensors (`blk.N.nextn.eh_proj`) and its attention block's under `mtp.`, as the
        checkpoints name them (`mtp.fc`, `mtp.layers.0.self_attn.q_proj`)."""
        whole = name.split(".", 2)  # blk, N, the rest: named whole (`ssm_a`, `ssm_dt.bias`)
        if (
            layers is not None
            and whole[0] == "blk"
            and len(whole) == 3
            and whole[1].isdecimal()
            and int(whole[1]) >= layers
        ):
            return self._head_name(int(whole[1]) - layers, name)
        if whole[0] == "blk" and len(whole) == 3 and whole[2] in self.gguf_names:
            return f"model.layers.{whole[1]}.{self.gguf_names[whole[2]]}"
        stem, _, suffix = name.rpartition(".")
        parts = stem.split(".", 2)  # a role may have dots of its own (shortconv.conv)
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in self.gguf_names:
            return f"model.layers.{parts[1]}.{self.gguf_names[parts[2]]}.{suffix}"
        if stem in self.gguf_globals:
            return f"{self.gguf_globals[stem]}.{suffix}"
        return None

    def _head_name(self, block: int, name: str) -> str | None:
        """The MTP head's `block`-th block's tensor `name` (blk.N...) -> the model's."""
        stem, _, suffix = name.rpartition(".")
        role = stem.split(".", 2)[2]
        if role in NEXTN_NAMES:
            return f"mtp.{NEXTN_NAMES[role]}.{suffix}"
        inner = self.from_gguf_name(f"blk.0.{role}.{suffix}")
        if inner is None:
            return None
        return f"mtp.layers.{block}.{inner.removeprefix('model.layers.0.')}"

    def to_gguf_name(self, name: str) -> str:
        """The inverse of `from_gguf_name` (the name itself where it has no GGUF name; an
        MTP head's tensor by its role, `nextn.eh_proj`, or `blk.M.` where M counts the
        head's blocks from 0)."""
        stem, _, suffix = name.rpartition(".")
        for ours, theirs in NEXTN_NAMES.items():
            if stem == f"mtp.{theirs}":
                return f"{ours}.{suffix}"
        if name.startswith("mtp.layers."):
            block, _, rest = name.removeprefix("mtp.layers.").partition(".")
            return self.to_gguf_name(f"model.layers.{block}.{rest}")
        for ours, theirs in self.gguf_globals.items():
            if stem == theirs:
                return f"{ours}.{suffix}"
        m = _LAYER.fullmatch(name)
        if m is not None:
            for ours, theirs in self.gguf_names.items():
                if f"{m[2]}.{m[3]}" == theirs:  # named whole
                    return f"blk.{m[1]}.{ours}"
            for ours, theirs in self.gguf_names.items():
                if m[2] == theirs:
                    return f"blk.{m[1]}.{ours}.{m[3]}"
        return name

    def from_hf_name(self, name: str) -> str:
        """A checkpoint's (text model's) tensor name -> the model's."""
        stem, _, suffix = name.rpartition(".")
        if stem in self.hf_globals:
            return f"{self.hf_globals[stem]}.{suffix}"
        m = _LAYER.fullmatch(name)
        if m is not None and f"{m[2]}.{m[3]}" in self.hf_names:  # named whole
            return f"model.layers.{m[1]}.{self.hf_names[f'{m[2]}.{m[3]}']}"
        ours = None if m is None else _renamed(self.hf_names, m[2])
        return name if ours is None else f"model.layers.{m[1]}.{ours}.{m[3]}"

    def to_hf_name(self, name: str) -> str:
        """The model's tensor name -> the checkpoint's (for messages)."""
        stem, _, suffix = name.rpartition(".")
        for theirs, ours in self.hf_globals.items():
            if stem == ours:
                return f"{theirs}.{suffix}"
        m = _LAYER.fullmatch(name)
        if m is not None:
            for theirs, ours in self.hf_names.items():
                if f"{m[2]}.{m[3]}" == ours:  # named whole
                    return f"model.layers.{m[1]}.{theirs}"
        theirs = None if m is None else _renamed({v: k for k, v in self.hf_names.items()}, m[2])
        return name if theirs is None else f"model.layers.{m[1]}.{theirs}.{m[3]}"


def _renamed(names: Mapping[str, str], stem: str) -> str | None:
    """`names`' rename of a layer tensor's `stem`, where one key is the stem or, with its
    first index segment as `*` (`experts.*.w1`: any expert's), stands for it; None: none."""
    if stem in names:
        return names[stem]
    index = _INDEX.search(stem)
    if index is None:
        return None
    key = f"{stem[: index.start()]}.*.{stem[index.end() :]}"
    return names[key].replace("*", index[1], 1) if key in names else None


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (its converter's `undo_permute`, which the
    Llama family's files and others built on its converter class carry).

    Within each head, HF orders rows [x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}] (rotate-half
    pairs x_i, y_i); llama.cpp stores them interleaved [x_0, y_0, x_1, y_1, ...].
    """
    half = w.shape[0] // n_heads // 2
    # (heads, half, 2, ...) interleaved  ->  (heads, 2, half, ...) rotate-half
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def fold_a_log(config: ModelConfig, name: str, tensor: torch.Tensor, stored: str) -> torch.Tensor:
    """A recurrent layer's A_log from the -exp(A_log) llama.cpp's converter stores (GGUF
    tensor `stored`, `ssm_a`): the fp32 value whose exp, as the model takes it (fp32), is
    the file's value negated where one is (log of it, or the fp32 value next to it), so
    that exp(A_log) at run time is the value the file holds."""
    a = -tensor.float()
    if not bool((a > 0).all()) or not bool(torch.isfinite(a).all()):
        layer = name.split(".")[2]
        raise ModelLoadError(f"{config.name}: tensor blk.{layer}.{stored} holds values that "
                             "are not -exp(A_log) (each must be finite and below 0)")  # fmt: skip
    x = torch.log(a.double()).float()
    for toward in (torch.full_like(x, float("inf")), torch.full_like(x, -float("inf"))):
        step = torch.nextafter(x, toward)
        x = torch.where((x.exp() != a) & (step.exp() == a), step, x)
    return x.to(tensor.dtype)
