"""The shape the config gives every tensor the model reads, checked at load for every
source (a GGUF file, a folder of safetensors) before any tensor is read.

The model's buffers (the C decode step's scratch, the cache, RoPE tables) are sized from
the config, and its kernels read a weight by the config's sizes: a tensor of another shape
would be read past its end or written into a buffer too small. So every tensor the model
uses must have exactly the shape the config implies, and every tensor it needs must be
there; a file that breaks either ends in one ModelLoadError naming the file, the tensor,
its shape and the one expected. Tensors the model does not read (another layer count's,
a vision tower's) are left alone.
"""

from __future__ import annotations

from collections.abc import Callable

from kvlm.config import ModelConfig
from kvlm.errors import ModelLoadError
from kvlm.model.weights import BESIDE_NORMS, WeightSource, out_norms

Shape = tuple[int, ...]
# a multi-token-prediction head's norms (kvlm.model.mtp)
MTP_NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def expected_shapes(c: ModelConfig) -> dict[str, tuple[Shape, str]]:
    """Hugging Face name -> (its shape, [out, in] for a projection; the sizes that give
    it) for every tensor the model may read."""
    h, v, i, d = c.hidden_size, c.vocab_size, c.intermediate_size, c.head_dim
    q, kv = c.num_heads * d, c.num_kv_heads * d
    # q_proj's rows: the queries, and as many of the output gate's where there is one
    qg = 2 * q if c.attn_output_gate else q
    qgs = f"{'2 x ' if c.attn_output_gate else ''}num_heads {c.num_heads} x head_dim {d}"
    hs, qs, kvs = f"hidden_size {h}", f"num_heads {c.num_heads} x head_dim {d}", (
        f"num_kv_heads {c.num_kv_heads} x head_dim {d}")  # fmt: skip
    inter = f"intermediate_size {i}"
    out: dict[str, tuple[Shape, str]] = {
        "model.embed_tokens.weight": ((v, h), f"vocab_size {v}, {hs}"),
        "lm_head.weight": ((v, h), f"vocab_size {v}, {hs}"),
        "model.norm.weight": ((h,), hs),
        "rope_freqs.weight": ((c.rotary_dim // 2,), f"rotary dims {c.rotary_dim} / 2"),
    }
    norms = ["input_layernorm", "post_attention_layernorm", *out_norms(c)]
    # the model's layers, then a multi-token-prediction head's blocks (attention blocks)
    blocks = [f"model.layers.{i}" for i in range(c.num_layers)]
    blocks += [f"mtp.layers.{i}" for i in range(c.mtp_layers)]
    if c.mtp_layers:
        out["mtp.fc.weight"] = ((h, 2 * h), f"{hs}, 2 x {hs}")
        out |= {f"mtp.{n}.weight": ((h,), hs) for n in MTP_NORMS}
    for n_block, p in enumerate(blocks):
        out |= {f"{p}.{n}.weight": ((h,), hs) for n in norms}
        # a layer's own head geometry (ModelConfig.layer_head_dims, layer_kv_heads)
        own = n_block < c.num_layers
        d = c.head_dim_of(n_block) if own else c.head_dim
        hkv = c.kv_heads_of(n_block) if own else c.num_kv_heads
        q, kv = c.num_heads * d, hkv * d
        qg = 2 * q if c.attn_output_gate else q
        qgs = f"{'2 x ' if c.attn_output_gate else ''}num_heads {c.num_heads} x head_dim {d}"
        qs, kvs = f"num_heads {c.num_heads} x head_dim {d}", f"num_kv_heads {hkv} x head_dim {d}"
        i = c.intermediate_of(n_block) if own else c.intermediate_size  # the layer's own
        inter = f"intermediate_size {i}"
        for name, rows, cols, why in (
            ("self_attn.q_proj", qg, h, f"{qgs}, {hs}"),
            ("self_attn.k_proj", kv, h, f"{kvs}, {hs}"),
            ("self_attn.v_proj", kv, h, f"{kvs}, {hs}"),
            ("self_attn.o_proj", h, q, f"{hs}, {qs}"),
            ("mlp.gate_proj", i, h, f"{inter}, {hs}"),
            ("mlp.gate_up_proj", 2 * i, h, f"2 x {inter}, {hs}"),
            ("mlp.up_proj", i, h, f"{inter}, {hs}"),
            ("mlp.down_proj", h, i, f"{hs}, {inter}"),
        ):
            out[f"{p}.{name}.weight"] = ((rows, cols), why)
            out[f"{p}.{name}.bias"] = ((rows,), why.split(", ")[0])
        sizes = c.qk_norm_sizes if c.qk_norm_extent == "projection" else (d, d)
        for n, size in zip(("q_norm", "k_norm"), sizes, strict=True):
            why = f"head_dim {d}" if c.qk_norm_extent == "head" else f"the projection's {size}"
            out[f"{p}.self_attn.{n}.weight"] = ((size,), why)
        out[f"{p}.self_attn.sinks"] = ((c.num_heads,), f"num_heads {c.num_heads}")
        if n_block < c.num_layers:
            out[f"{p}.layer_scalar"] = ((1,), "one scalar a layer")
        if n_block < c.num_layers and c.per_layer_input:
            w = c.per_layer_input
            ws = f"per_layer_input {w}"
            out[f"{p}.per_layer_input_gate.weight"] = ((w, h), f"{ws}, {hs}")
            out[f"{p}.per_layer_projection.weight"] = ((h, w), f"{hs}, {ws}")
            out[f"{p}.post_per_layer_input_norm.weight"] = ((h,), hs)
    if c.per_layer_input:  # the per-layer inputs' table, projection and norm
        w, n = c.per_layer_input, c.num_layers
        every = f"layers {n} x per_layer_input {w}"
        out["model.embed_tokens_per_layer.weight"] = ((c.per_layer_vocab, n * w),
                                                      f"per_layer_vocab {c.per_layer_vocab}, "
                                                      f"{every}")  # fmt: skip
        out["model.per_layer_model_projection.weight"] = ((n * w, h), f"{every}, {hs}")
        out["model.per_layer_projection_norm.weight"] = ((w,), f"per_layer_input {w}")
    if c.conv_layers:
        out |= _conv_shapes(c)
    if c.deltanet_layers:
        out |= _deltanet_shapes(c)
    if c.mamba2_layers:
        out |= _mamba2_shapes(c)
    if c.expert_layers:
        out |= _expert_shapes(c)
    if c.latent_layers:
        out |= _latent_shapes(c)
    return out


def _latent_shapes(c: ModelConfig) -> dict[str, tuple[Shape, str]]:
    """The latent attention layers' tensors (kvlm.model.mla)."""
    x, h, H = c.latent, c.hidden_size, c.num_heads
    hs, heads = f"hidden_size {h}", f"num_heads {H}"
    qk, kv = f"{heads} x (nope {x.nope_dim} + rope {x.rope_dim})", f"kv_lora_rank {x.kv_rank}"
    out: dict[str, tuple[Shape, str]] = {}
    for i in c.latent_layers:
        a = f"model.layers.{i}.self_attn"
        for name, shape, why in (
            ("q_proj.weight", (H * x.qk_dim, h), f"{qk}, {hs}"),
            ("q_a_proj.weight", (x.q_rank, h), f"q_lora_rank {x.q_rank}, {hs}"),
            ("q_a_proj.bias", (x.q_rank,), f"q_lora_rank {x.q_rank}"),
            ("q_a_layernorm.weight", (x.q_rank,), f"q_lora_rank {x.q_rank}"),
            ("q_b_proj.weight", (H * x.qk_dim, x.q_rank), f"{qk}, q_lora_rank {x.q_rank}"),
            ("kv_a_proj_with_mqa.weight", (x.row, h), f"{kv} + rope {x.rope_dim}, {hs}"),
            ("kv_a_proj_with_mqa.bias", (x.row,), f"{kv} + rope {x.rope_dim}"),
            ("kv_a_layernorm.weight", (x.kv_rank,), kv),
            ("kv_b_proj.weight", (H * (x.nope_dim + x.v_dim), x.kv_rank),
             f"{heads} x (nope {x.nope_dim} + v {x.v_dim}), {kv}"),
            ("k_b_proj.weight", (H, x.kv_rank, x.nope_dim), f"{heads}, {kv}, nope {x.nope_dim}"),
            ("v_b_proj.weight", (H, x.v_dim, x.kv_rank), f"{heads}, v {x.v_dim}, {kv}"),
            ("o_proj.weight", (h, H * x.v_dim), f"{hs}, {heads} x v_head_dim {x.v_dim}"),
        ):  # fmt: skip
            out[f"{a}.{name}"] = (shape, why)
    return out


def _expert_shapes(c: ModelConfig) -> dict[str, tuple[Shape, str]]:
    """The mixture-of-experts layers' tensors (kvlm.model.experts): the router (experts,
    hidden), and each expert's gate, up and down, one tensor an expert (a Hugging Face
    checkpoint's `mlp.experts.E.gate_proj`) or every expert's stacked (llama.cpp's
    `ffn_gate_exps`: (experts, rows, columns))."""
    x, h = c.experts, c.hidden_size
    hs, es, ins = f"hidden_size {h}", f"{x.count} experts", f"expert intermediate {x.intermediate}"
    out: dict[str, tuple[Shape, str]] = {}
    heads = [f"mtp.layers.{i}.mlp" for i in range(c.mtp_layers)]  # an MTP head's blocks too
    for p in [f"model.layers.{layer}.mlp" for layer in c.expert_layers] + heads:
        out[f"{p}.gate.weight"] = ((x.count, h), f"{es}, {hs}")
        out[f"{p}.router_norm.weight"] = ((h,), hs)  # the router's input norm
        out[f"{p}.expert_scale"] = ((x.count,), es)  # each expert's weight scale
        if x.beside_mlp:  # the norms around the experts beside the dense MLP
            out |= {f"{p.removesuffix('.mlp')}.{n}.weight": ((h,), hs) for n in BESIDE_NORMS}
        out[f"{p}.expert_bias"] = ((x.count,), es)  # a selection bias (sigmoid routers)
        out[f"{p}.gate.bias"] = ((x.count,), es)  # the router's own bias
        parts = (("gate_proj", x.intermediate, h, f"{ins}, {hs}"),
                 ("up_proj", x.intermediate, h, f"{ins}, {hs}"),
                 ("down_proj", h, x.intermediate, f"{hs}, {ins}"))  # fmt: skip
        for name, rows, cols, why in parts:
            out[f"{p}.experts.{name}.weight"] = ((x.count, rows, cols), f"{es}, {why}")
            out[f"{p}.experts.{name}.bias"] = ((x.count, rows), f"{es}, {why.split(', ')[0]}")
            out |= {f"{p}.experts.{e}.{name}.weight": ((rows, cols), why) for e in range(x.count)}
        out[f"{p}.experts.gate_up_proj.weight"] = ((x.count, 2 * x.intermediate, h),
                                                   f"{es}, 2 x {ins}, {hs}")  # fmt: skip
        out[f"{p}.experts.gate_up_proj.bias"] = ((x.count, 2 * x.intermediate), f"{es}, 2 x {ins}")
        if x.shared:
            sh = f"shared expert intermediate {x.shared}"
            out |= {f"{p}.shared_expert.gate_proj.weight": ((x.shared, h), f"{sh}, {hs}"),
                    f"{p}.shared_expert.up_proj.weight": ((x.shared, h), f"{sh}, {hs}"),
                    f"{p}.shared_expert.down_proj.weight": ((h, x.shared), f"{hs}, {sh}"),
                    f"{p}.shared_expert_gate.weight": ((1, h), f"1, {hs}")}  # fmt: skip
    return out


def _mamba2_shapes(c: ModelConfig) -> dict[str, tuple[Shape, str]]:
    """The Mamba2 layers' tensors (kvlm.model.mamba2): in_proj to z|x|B|C|dt, the
    depthwise kernel over x|B|C ((C, 1, L) as transformers' Conv1d stores it, or (C, L))
    and its bias, A_log, D and dt_bias (or (heads, 1), llama.cpp's), the gated norm's
    weight (or (groups, inner / groups)), out_proj."""
    m, h = c.mamba2, c.hidden_size
    hs, cw, n, inner = f"hidden_size {h}", m.conv_width, m.heads, m.inner
    cws = f"{n} heads x {m.head_dim} + 2 x {m.groups} groups x {m.state_size} (x|B|C)"
    ins, ns = f"{n} heads x {m.head_dim}", f"{n} heads"
    proj = inner + cw + n
    out: dict[str, tuple[Shape, str]] = {}
    for layer in c.mamba2_layers:
        p = f"model.layers.{layer}.mamba"
        out |= {
            f"{p}.in_proj.weight": ((proj, h), f"2 x {ins} + 2 x {m.groups} x {m.state_size} "
                                               f"+ {ns} (z|x|B|C|dt), {hs}"),
            f"{p}.in_proj.bias": ((proj,), "z|x|B|C|dt"),
            f"{p}.conv1d.weight": ((cw, m.conv_kernel), f"{cws}, conv kernel {m.conv_kernel}"),
            f"{p}.conv1d.bias": ((cw,), cws),
            f"{p}.A_log": ((n,), ns),
            f"{p}.D": ((n,), ns),
            f"{p}.dt_bias": ((n,), ns),
            f"{p}.norm.weight": ((inner,), ins),
            f"{p}.out_proj.weight": ((h, inner), f"{hs}, {ins}"),
            f"{p}.out_proj.bias": ((h,), hs),
        }  # fmt: skip
    return out


def _deltanet_shapes(c: ModelConfig) -> dict[str, tuple[Shape, str]]:
    """The gated DeltaNet layers' tensors (kvlm.model.deltanet): in_proj_qkv, in_proj_z,
    in_proj_b, in_proj_a, the depthwise kernel over q|k|v ((C, 1, L) as transformers'
    Conv1d stores it, or (C, L): `_same`), A_log, dt_bias, the gated norm, out_proj."""
    d, h = c.deltanet, c.hidden_size
    hs, cw, nv = f"hidden_size {h}", d.conv_width, d.value_heads
    cws = f"2 x {d.key_heads} x {d.key_dim} + {nv} x {d.value_dim} (q|k|v)"
    vd = nv * d.value_dim
    vds, nvs = f"{nv} value heads x {d.value_dim}", f"{nv} value heads"
    out: dict[str, tuple[Shape, str]] = {}
    for layer in c.deltanet_layers:
        p = f"model.layers.{layer}.linear_attn"
        out |= {
            f"{p}.in_proj_qkv.weight": ((cw, h), f"{cws}, {hs}"),
            f"{p}.in_proj_z.weight": ((vd, h), f"{vds}, {hs}"),
            f"{p}.in_proj_b.weight": ((nv, h), f"{nvs}, {hs}"),
            f"{p}.in_proj_a.weight": ((nv, h), f"{nvs}, {hs}"),
            f"{p}.conv1d.weight": ((cw, d.conv_kernel), f"{cws}, conv kernel {d.conv_kernel}"),
            f"{p}.A_log": ((nv,), nvs),
            f"{p}.dt_bias": ((nv,), nvs),
            f"{p}.norm.weight": ((d.value_dim,), f"value head dim {d.value_dim}"),
            f"{p}.out_proj.weight": ((h, vd), f"{hs}, {vds}"),
            f"{p}.out_proj.bias": ((h,), hs),
        }
    return out


def _conv_shapes(c: ModelConfig) -> dict[str, tuple[Shape, str]]:
    """The short convolutions' tensors (kvlm.model.conv): in_proj to B, C, x, the
    depthwise kernel (hidden, L: llama.cpp's; transformers' Conv1d has (hidden, 1, L),
    `_same`), out_proj."""
    h, k = c.hidden_size, c.conv_kernel
    hs, three = f"hidden_size {h}", f"3 x hidden_size {h}"
    out: dict[str, tuple[Shape, str]] = {}
    for layer in c.conv_layers:
        p = f"model.layers.{layer}.conv"
        out |= {
            f"{p}.in_proj.weight": ((3 * h, h), f"{three}, {hs}"),
            f"{p}.in_proj.bias": ((3 * h,), three),
            f"{p}.conv.weight": ((h, k), f"{hs}, conv_kernel {k}"),
            f"{p}.conv.bias": ((h,), hs),
            f"{p}.out_proj.weight": ((h, h), f"{hs}, {hs}"),
            f"{p}.out_proj.bias": ((h,), hs),
        }
    return out


def _same(name: str, got: Shape, want: Shape) -> bool:
    """`got` is the shape `want` (a depthwise kernel (hidden, L) also as (hidden, 1, L); a
    Mamba2 layer's per-head vectors also as (heads, 1), its norm's weight as (groups,
    inner / groups), as llama.cpp's converter stores them)."""
    depthwise = name.endswith((".conv.conv.weight", ".linear_attn.conv1d.weight",
                               ".mamba.conv1d.weight"))  # fmt: skip
    kernel = depthwise and got == (want[0], 1, *want[1:])
    vector = name.endswith((".mamba.A_log", ".mamba.D", ".mamba.dt_bias", ".mamba.norm.weight"))
    split = vector and len(got) == 2 and got[0] * got[1] == want[0] and got[0] >= 1
    return got == want or kernel or split


def required(c: ModelConfig, head: bool = False) -> list[str]:
    """The tensors every model of this config needs (not lm_head: without one the
    embeddings are tied; nor biases or the RoPE factors); with `head`, its
    multi-token-prediction head's too (a file that has one has it whole)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if c.per_layer_input:
        names += ["model.embed_tokens_per_layer.weight",
                  "model.per_layer_model_projection.weight",
                  "model.per_layer_projection_norm.weight"]  # fmt: skip
    norms = ["input_layernorm", "post_attention_layernorm"]
    mlp = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", *out_norms(c)]
    attention = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    attention_parts = norms + attention + mlp
    if c.qk_norm:
        attention_parts += ["self_attn.q_norm", "self_attn.k_norm"]
    conv_parts = [*norms, "conv.in_proj", "conv.conv", "conv.out_proj", *mlp]
    delta = [
        f"linear_attn.{n}"
        for n in (
            "in_proj_qkv",
            "in_proj_z",
            "in_proj_b",
            "in_proj_a",
            "conv1d",
            "norm",
            "out_proj",
        )
    ]
    delta_parts = [*norms, *delta, *mlp]
    x = c.latent
    query = ["self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj"]
    latent_parts = [*norms, *(query if x and x.q_rank else ["self_attn.q_proj"]),
                    *(f"self_attn.{n}" for n in ("kv_a_proj_with_mqa", "kv_a_layernorm",
                                                 "kv_b_proj", "o_proj")), *mlp]  # fmt: skip
    mamba_parts = [*norms, *(f"mamba.{n}" for n in ("in_proj", "conv1d", "norm", "out_proj")),
                   *mlp]  # fmt: skip

    def routed(parts: list[str]) -> list[str]:
        """A block's parts with a mixture of experts in place of its MLP: the router, the
        experts, and the shared expert and its gate where the model has them."""
        x = c.experts
        shared = ("gate_proj", "up_proj", "down_proj") if x.shared else ()
        # beside the dense MLP (Experts.beside_mlp): the MLP kept, and the experts' norms
        kept = parts if x.beside_mlp else [n for n in parts if n not in mlp[:3]]
        return [
            *kept,
            "mlp.gate",
            *(f"mlp.experts.{n}" for n in ("gate_proj", "up_proj", "down_proj")),
            *(f"mlp.shared_expert.{n}" for n in shared),
            *(["mlp.shared_expert_gate"] if x.shared_gate else []),
            *(["mlp.router_norm"] if x.router_norm else []),
            *(BESIDE_NORMS if x.beside_mlp else ()),
        ]

    for layer in range(c.num_layers):
        parts = attention_parts
        if layer in c.conv_layers:
            parts = conv_parts
        elif layer in c.deltanet_layers:
            parts = delta_parts
            names += [f"model.layers.{layer}.linear_attn.{n}" for n in ("A_log", "dt_bias")]
        elif layer in c.latent_layers:
            parts = latent_parts
        elif layer in c.mamba2_layers:
            parts = mamba_parts
            names += [f"model.layers.{layer}.mamba.{n}" for n in ("A_log", "D", "dt_bias")]
        if parts is attention_parts and c.kv_source(layer) != layer:  # reads another's K/V
            parts = [n for n in parts if n not in ("self_attn.k_proj", "self_attn.v_proj",
                                                   "self_attn.k_norm")]  # fmt: skip
        elif parts is attention_parts and c.k_eq_v(layer):  # one projection for K and V
            parts = [n for n in parts if n != "self_attn.v_proj"]
        if layer in c.expert_layers:  # the router and the experts in place of the MLP
            parts = routed(parts)
            if c.experts.selection_bias:  # a vector with no `.weight`
                names.append(f"model.layers.{layer}.mlp.expert_bias")
            if c.experts.expert_scale:  # likewise
                names.append(f"model.layers.{layer}.mlp.expert_scale")
        if c.per_layer_input:
            parts = [*parts, "per_layer_input_gate", "per_layer_projection",
                     "post_per_layer_input_norm"]  # fmt: skip
        if c.layer_scalars:
            names.append(f"model.layers.{layer}.layer_scalar")
        names += [f"model.layers.{layer}.{part}.weight" for part in parts]
        if c.attn_sinks and "self_attn.q_proj" in parts:  # a logit a head (no .weight)
            names.append(f"model.layers.{layer}.self_attn.sinks")
    if head:  # an MTP head's blocks: attention blocks of the model's FFN kind
        head_parts = routed(attention_parts) if c.expert_layers else attention_parts
        names += [f"mtp.{n}.weight" for n in ("fc", *MTP_NORMS)]
        names += [f"mtp.layers.{i}.{part}.weight" for i in range(c.mtp_layers)
                  for part in head_parts]  # fmt: skip
    return names


def check_shapes(
    weights: WeightSource, c: ModelConfig, where: str, file_name: Callable[[str], str] = str
) -> list[str]:
    """ModelLoadError unless every tensor of `weights` the model reads has the shape `c`
    gives it and every one it needs is there (`where`: the file, and `file_name`: a
    tensor's name there, for the message); the names of the tensors the model reads."""
    have = set(weights.names())
    head = c.mtp_layers > 0 and any(n.startswith("mtp.") for n in have)
    for name in required(c, head):
        # a gate and up stored as one tensor (mlp.gate_up_proj) stand for both
        fused = name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight"))
        if fused and f"{name.rsplit('.mlp.', 1)[0]}.mlp.gate_up_proj.weight" in have:
            continue
        if ".mlp.experts." in name:  # every expert's stacked, or one tensor an expert
            head, part = name.rsplit(".mlp.experts.", 1)
            each = [f"{head}.mlp.experts.{e}.{part}" for e in range(c.experts.count)]
            if name not in have and all(n in have for n in each):
                continue
            if part != "down_proj.weight" and f"{head}.mlp.experts.gate_up_proj.weight" in have:
                continue  # gate and up stacked as one
        split = [name.replace("kv_b", p) for p in ("k_b", "v_b")]  # kv_b split per head
        if name.endswith(".self_attn.kv_b_proj.weight") and all(n in have for n in split):
            continue
        if ".mlp.shared_expert." in name and name not in have:  # or under the MLP's names
            head, part = name.rsplit(".mlp.shared_expert.", 1)
            fused_up = part != "down_proj.weight" and f"{head}.mlp.gate_up_proj.weight" in have
            if fused_up or f"{head}.mlp.{part}" in have:
                continue
        if name not in have:
            raise ModelLoadError(f"{where}: no tensor {file_name(name)} (the model has "
                                 f"{c.num_layers} layers)")  # fmt: skip
    shapes = expected_shapes(c)
    used = [n for n in weights.names() if n in shapes]
    for name in used:
        got, (want, why) = tuple(weights.shape(name)), shapes[name]
        if not _same(name, got, want):
            stored = weights.stored_as(name)[0]
            raise ModelLoadError(f"{where}: tensor {stored} has shape {got}, where the "
                                 f"config's sizes give {want} ({why})")  # fmt: skip
    return used
