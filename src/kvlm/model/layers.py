"""Building blocks: Linear (layout chosen per dtype), RMSNorm, RoPE, the gated MLP."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from kvlm import kernels
from kvlm.config import ModelConfig
from kvlm.model.numerics import ModelNumerics
from kvlm.model.quant import (
    PROMPT_BLOCK,
    SMALL_M,
    QuantWeight,
    onednn_rows,
    row_blocks,
)

# oneDNN picks its packed layout for this many rows; one packing serves any count.
ONEDNN_BATCH_HINT = 64
# Row counts oneDNN runs as they are (decode batches); larger ones are padded (onednn_rows).
ONEDNN_EXACT_ROWS = 16


_ROLE = threading.local()


@contextmanager
def feeding_prompt(prompt: bool) -> Iterator[None]:
    """Within: the projections' rows are prompt tokens (True) or decoded tokens (False),
    which picks their numerics (`Linear`: --prefill-dtype for prompt rows, --activations
    for decoded ones), whatever the number of rows."""
    before = getattr(_ROLE, "prompt", None)
    _ROLE.prompt = prompt
    try:
        yield
    finally:
        _ROLE.prompt = before


def prompt_rows(x: torch.Tensor) -> bool:
    """Whether x (..., T, K) holds prompt rows: as the model said (`feeding_prompt`), else
    T > 1 tokens per sequence."""
    said = getattr(_ROLE, "prompt", None)
    return said if said is not None else x.dim() >= 2 and x.shape[-2] > 1


class Linear(nn.Module):
    """y = x @ W^T + b, from a Hugging Face weight [out, in], with one kernel for its dtype
    and device, chosen once at construction, whose rows do not depend on the rows beside
    them (a decode row gets the same bits alone or in any batch, on any thread count):

    - CPU fp32 or bf16 where oneDNN runs the dtype: the weight packed once for oneDNN
      ("onednn"). `bf16=True` with an fp32 weight: packed as bf16, the inputs cast to bf16
      for the product only, so norms, attention and the residual stream keep fp32 ("bf16").
    - CPU fp32 without oneDNN: torch's matmul on [in, out], decode rows in calls of one
      shape ("cpu-fp32").
    - anything else (GPU, fp16, ...): `F.linear` on [out, in].

    numpy's OpenBLAS ran one fp32 row faster (a 576x49152 product 3.0 ms against oneDNN's
    3.5-4.6, 2 threads of a Zen 4), but a row's bits in its multi-row product (or MKL's,
    which the fp32 layout sent batches to) are not its bits alone, MKL's below 4 rows
    neither, and one-row products in turn read the weight once per row
    (benchmarks/bench_kernels.py, BENCHMARKS 23).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        bf16: bool = False,
        numerics: ModelNumerics | None = None,
        vocabulary: bool = False,
    ) -> None:
        """`numerics`: how its low-bit products round (fp32 without); `vocabulary`: the
        vocabulary projection, whose products stay fp32 whatever `numerics` say: its
        near-tied logits decide the token (on the default model, rounding its input too
        changed 7 of 8 test prompts' answers, and bf16 logits tie at 2^-8:
        docs/BENCHMARKS.md), and whose prompt rows take the road of single rows (a
        prompt's last row alone gets the bits it gets among all of them)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = _pick_kernel(weight, bf16)
        if self.kernel == "cpu-fp32":
            w = weight.t().contiguous()  # [in, out]
        elif self.kernel == "bf16":
            w = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16).contiguous(), 1)
        elif self.kernel == "onednn":
            hint = ONEDNN_BATCH_HINT if weight.dtype == torch.float32 else 1
            w = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), hint)
        else:
            w = weight.contiguous()
        self.register_buffer("weight", w, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.quant: QuantWeight | None = None  # low-bit weights (kernel "quant")
        # how its low-bit products round (QuantWeight.matmul): prompt rows in bf16 or on
        # int8 activations; decoded rows on int8 activations, and with act_int16 an int8
        # residual too (16 bits a value)
        n = ModelNumerics() if numerics is None or vocabulary else numerics
        self.prefill_bf16 = n.prefill_dtype == "bf16"
        self.prefill_int8 = n.prefill_dtype == "int8"
        self.act_int8 = n.activations in ("int8", "int16")
        self.act_int16 = n.activations == "int16"
        self.vocabulary = vocabulary

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: where low-bit kernels may write the result (x's rows by out_features,
        fp32, contiguous; the returned tensor is the result either way)."""
        # Prompt rows take the prefill numerics, decode rows the decode ones, however many
        # rows share the call: a prompt's K/V are the same chunked or whole, alone or beside
        # others (the model says which: `prompt_rows`). Dense prompt products run in calls
        # of one shape (kvlm.model.quant.row_blocks), so a row's bits are its own.
        prompt = prompt_rows(x) and x.is_cpu and x.dtype != torch.float64
        if prompt and self.kernel in ("onednn", "bf16", "cpu-fp32"):
            return self._blocked(x, SMALL_M if self.vocabulary else PROMPT_BLOCK)
        if self.kernel == "onednn":
            return self._onednn(x, self.bias)
        if self.kernel == "bf16":  # bf16 weight, model dtype kept outside the product
            y = self._onednn(x.to(torch.bfloat16), None).to(x.dtype)
            return y if self.bias is None else y + self.bias.to(x.dtype)
        if self.kernel == "cpu-fp32":  # calls of one shape: MKL sums 1-3 rows otherwise
            return self._blocked(x, SMALL_M)
        if self.kernel == "quant":
            flat = x.reshape(-1, self.in_features)
            if flat.dtype not in (torch.float32, torch.float64) or not flat.is_contiguous():
                flat = flat.float().contiguous()  # fp64: QuantWeight's exact reference
            prompt = prompt_rows(x)
            int8 = self.prefill_int8 if prompt else self.act_int8
            fine = self.act_int16 and not prompt
            out = out if x.dtype == torch.float32 else None
            dense = prompt and not self.vocabulary  # a block's prompt rows: the dense road
            y = self.quant.matmul(flat, self.prefill_bf16 and prompt, int8, out=out,
                                  act_int16=fine, prompt=dense)  # fmt: skip
            y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        else:
            return F.linear(x, self.weight, self.bias)
        return y if self.bias is None else y + self.bias

    def _blocked(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """x's rows through a dense weight, `rows` rows a call (row_blocks: prompt rows
        PROMPT_BLOCK, the vocabulary projection's SMALL_M; without oneDNN decode rows
        SMALL_M), in the weight's dtype."""
        flat = x.reshape(-1, self.in_features)
        flat = flat.to(torch.bfloat16) if self.kernel == "bf16" else flat
        y = row_blocks(flat, self._block_product, self.out_features, rows).to(x.dtype)
        y = y.view(*x.shape[:-1], self.out_features)
        fused = self.kernel == "onednn"  # the bias inside the product, as in `_onednn`
        return y if self.bias is None or fused else y + self.bias.to(x.dtype)

    def _block_product(self, xb: torch.Tensor) -> torch.Tensor:
        """One call of `_blocked`: MKL's GEMM on
        the [in, out] weight, or oneDNN's on its packed one with the bias where a decode
        row's has it (the result in fp32: a bf16 product's rounded to bf16 first, once)."""
        if self.kernel == "cpu-fp32":
            return torch.matmul(xb, self.weight)
        bias = self.bias if self.kernel == "onednn" else None
        return torch.ops.mkldnn._linear_pointwise(xb, self.weight, bias, "none", [], "").float()

    def _onednn(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """oneDNN keeps a primitive (with its buffers) per row count it has seen, up to
        1,024 of them: a server feeding prompts of every length grew by ~0.8 MiB/s (RSS,
        benchmarks/bench_serve.py soak). Row counts above ONEDNN_EXACT_ROWS are padded
        (kvlm.model.quant.onednn_rows), so the shapes, and that memory, stay few. A row's
        result does not depend on the rows beside it, so the padding changes no bit."""
        rows = x.numel() // self.in_features
        pad = onednn_rows(rows) - rows if rows > ONEDNN_EXACT_ROWS else 0
        if rows == 1:
            pad = 1  # oneDNN's one-row kernel sums long rows (fp32 K > 1024, bf16 K >= 2048 on
        # a Zen 4) in another order than its multi-row one; as two rows, one row gets the
        # bits it gets in any batch
        flat = x.reshape(rows, self.in_features)
        if pad:
            flat = F.pad(flat, (0, 0, 0, pad))
        y = torch.ops.mkldnn._linear_pointwise(flat, self.weight, bias, "none", [], "")
        return y[:rows].view(*x.shape[:-1], self.out_features)

    @classmethod
    def from_quant(
        cls,
        quant: QuantWeight,
        bias: torch.Tensor | None = None,
        numerics: ModelNumerics | None = None,
        vocabulary: bool = False,
    ) -> Linear:
        """A projection over low-bit weights (kvlm.model.quant): a GGUF file's own blocks."""
        meta = torch.empty(quant.out_features, 0, device="meta")
        lin = cls(meta, bias, numerics=numerics, vocabulary=vocabulary)
        lin._set_quant(quant)
        return lin

    def _set_quant(self, quant: QuantWeight) -> None:
        self.in_features, self.out_features = quant.in_features, quant.out_features
        self.quant = quant
        self._store("quant", quant.data)

    def _store(self, kernel: str, weight: torch.Tensor) -> None:
        """Keep the weight as `weight` (its new layout), multiplied by `kernel`."""
        self.weight, self.kernel = weight, kernel

    @property
    def nbytes(self) -> int:
        """Bytes of weight a product reads (codes and their scales for low-bit weights)."""
        if self.kernel == "quant":
            return self.quant.nbytes
        if self.kernel == "bf16":
            return self.in_features * self.out_features * 2
        return self.weight.numel() * self.weight.element_size()

    def dense_weight(self) -> torch.Tensor:
        """The weight as [out, in] in a plain layout (dequantized for low-bit weights)."""
        if self.kernel == "cpu-fp32":
            return self.weight.t()
        if self.kernel == "quant":
            return self.quant.dense()
        if self.kernel in ("onednn", "bf16"):
            raise ValueError("a oneDNN-packed weight cannot be read back")
        return self.weight

    def rows(self) -> torch.Tensor | None:
        """The weight as [out, in] (a view when stored transposed), usable as an embedding
        table; None when it is packed in a kernel-specific layout."""
        return None if self.kernel in ("onednn", "bf16", "quant") else self.dense_weight()


def _pick_kernel(weight: torch.Tensor, bf16: bool) -> str:
    """`bf16`: an fp32 weight stored as bf16 for the product (where oneDNN runs bf16; an
    AVX2 CPU such as a Zen 3 keeps fp32)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return "torch"
    if bf16 and weight.dtype == torch.float32 and _onednn_works(torch.bfloat16):
        return "bf16"
    if _onednn_works(weight.dtype):
        return "onednn"
    return "cpu-fp32" if weight.dtype == torch.float32 else "torch"


@cache
def _onednn_works(dtype: torch.dtype) -> bool:
    """oneDNN can run packed products of this dtype here: ask it once (bf16 needs
    AVX512-BF16/AMX, or oneDNN's emulation on AVX512)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
        x = torch.ones(1, 8, dtype=dtype)
        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c_rows = x.dtype == torch.float32 and x.is_cpu and x.is_contiguous() and x.numel() > 0
        if c_rows and self.c_weight() is not None:
            # kvlm's C RMSNorm, a row at a time (torch's rms_norm on CPU: six passes over
            # the rows, ~5% of a 512-token prefill); each buffer's length from the tensor
            # itself: a -2 (a weight of another length than a row, a buffer shorter than
            # its rows) is a caller's bug, not a road to torch
            n, y, w = x.shape[-1], torch.empty_like(x), self.weight
            m = x.numel() // n
            rc = kernels.library().kvlm_rms_norm(x.data_ptr(), x.numel(), m, n, n, w.data_ptr(),
                                                 w.numel(), self.eps, y.data_ptr(), y.numel(),
                                                 n)  # fmt: skip
            if rc != 0:
                raise ValueError(f"the kernels refused RMSNorm of {m} rows of {n} by a weight "
                                 f"of {w.numel()}")  # fmt: skip
            return y
        # fp32/fp64; or one fused kernel on a GPU (fp32 inside, one rounding at the end),
        # where the steps below are eight: a decode step is launch-bound there
        if x.dtype in (torch.float32, torch.float64) or (
            not x.is_cpu and x.dtype == self.weight.dtype
        ):
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Low precision: normalise in fp32 and scale after casting back, as HF does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def c_weight(self) -> torch.Tensor | None:
        """The weight, where kvlm's C kernels can take it (fp32, contiguous, on the CPU,
        the kernels built), else None."""
        w = self.weight
        if w.dtype != torch.float32 or not w.is_cpu or not w.is_contiguous():
            return None
        return w if kernels.library() is not None else None


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half convention, evaluated at explicit integer positions.

    Positions come from the caller (the cache owns them), so prefill, decode and a chunk
    in the middle of a prompt all go through the same `forward(positions)`.
    """

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        freq_factors: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        if not config.rope:  # NoPE: angle 0 at every position, cos 1 and sin 0 (q, k kept)
            inv_freq = torch.zeros_like(inv_freq)
        if freq_factors is not None:  # GGUF `rope_freqs`: per-frequency divisors (Llama 3.x)
            inv_freq = inv_freq / freq_factors.float().cpu()
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        # YaRN's cos/sin scale (1 otherwise): every road (the torch step, the C q/k pass,
        # the fused step's tables, a window cache's keys) takes cos/sin from forward
        self.attention_scaling = config.rope_scaling.attention_scaling

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) int64 -> cos, sin (B, T, 1, D), broadcasting over heads of a
        (B, T, heads, D) tensor."""
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, D/2), fp32 as HF
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]  # (B, T, 1, D)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # scaled in fp32 before the cast, as HF
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def for_keys(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (S,) int64 -> cos, sin (1, 1, S, D), broadcasting over keys (B, heads,
        S, D): for a cache that returns K before RoPE (kvlm.cache.window). (B, S): each
        row's own positions -> (B, 1, S, D) (a window cache's draft rows)."""
        cos, sin = self(positions if positions.dim() == 2 else positions[None], dtype)
        return cos.transpose(1, 2), sin.transpose(1, 2)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """The D/2 frequencies of `config.rope_scaling` (kvlm.config.RopeScaling), each as
    transformers' ROPE_INIT_FUNCTIONS computes it, bit for bit (tests/test_context.py);
    D is the dimensions rotated (`ModelConfig.rotary_dim`: head_dim but for a partial
    rotary factor)."""
    dim = config.rotary_dim
    scaling = config.rope_scaling
    if scaling.rope_type == "proportional":  # the first pairs turn, over exponents of dim
        turning = int(scaling.proportion * dim // 2)
        exponent = torch.arange(0, 2 * turning, 2, dtype=torch.int64).float() / dim
        inv_freq = torch.cat([1.0 / (config.rope_theta**exponent),
                              torch.zeros(dim // 2 - turning)])  # fmt: skip
        return inv_freq / scaling.factor
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponent)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(config.rope_theta**exponent, dim, config.rope_theta, scaling)
    return inv_freq


def _yarn_inv_freq(pos_freqs: torch.Tensor, dim: int, base: float, s) -> torch.Tensor:
    """YaRN's frequencies: dimensions that turn more than `beta_fast` times over the
    original length keep theirs (extrapolated), those turning fewer than `beta_slow`
    times are divided by `factor` (interpolated), a linear ramp between."""

    def dim_of(turns: float) -> float:  # the dimension that turns `turns` times
        length = s.original_max_position_embeddings
        return (dim * math.log(length / (turns * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by 0
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the dimension's own frequency, 0: divided by factor
    interpolated, extrapolated = 1.0 / (s.factor * pos_freqs), 1.0 / pos_freqs
    return interpolated * (1 - kept) + extrapolated * kept


def _llama3_inv_freq(inv_freq: torch.Tensor, s) -> torch.Tensor:
    """Llama 3.1's frequency-dependent stretch: long wavelengths are divided by `factor`,
    short ones kept, the band between interpolated smoothly."""
    old_len = s.original_max_position_embeddings
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D) rotated by cos/sin (B, T, 1, D): x*cos + rotate_half(x)*sin. Any layout
    whose cos/sin broadcast works the same, element by element: (B, H, S, D) by (1, 1, S, D).
    cos/sin of fewer dimensions R than x's (a partial rotary factor): x's first R rotated
    (rotate_half among them), the rest as they are, as transformers rotates them."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


_TRANSIENT = threading.local()
# A low-bit MLP takes a prompt this many rows at a time: its gate|up buffer and SwiGLU's
# are those of PIECE_ROWS rows (a row's results are its own in any piece). 256, not 512:
# a 350M-parameter Q8_0 model's peak RSS 709-716 MiB instead of 729-732 for a 512-token
# prompt, TTFT within the runs' spread (BENCHMARKS 24.14)
PIECE_ROWS = 256


def _transient(numel: int) -> torch.Tensor:
    """A per-thread fp32 buffer of at least `numel`, reused: for a result read once, at
    once (the prompt's gate|up product). Grows, never shrinks: bounded by the prefill
    chunk."""
    buf = getattr(_TRANSIENT, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _TRANSIENT.buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel]


class MLP(nn.Module):
    """SwiGLU (`act` "silu"), or GeGLU with tanh's GELU (`act` "gelu_tanh"), with the gate
    and up projections fused into one matmul (ModelConfig.activation); or an expert's
    clamped SwiGLU (`act` "clamped_swiglu", `swiglu` = (alpha, limit): `clamped_swiglu`)."""

    def __init__(
        self, gate_up: Linear, down: Linear, act: str = "silu",
        swiglu: tuple[float, float] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.gate_up = gate_up
        self.down = down
        self.act = act
        if act == "clamped_swiglu" and swiglu is None:
            raise ValueError("a clamped SwiGLU needs its (alpha, limit)")
        self.swiglu = swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.gate_up.kernel == "quant" and rows > PIECE_ROWS:
            # a long prompt in pieces of rows (each row's result is its own): the gate|up
            # buffer and SwiGLU's stay those of PIECE_ROWS rows, whatever the prompt
            role, flat = prompt_rows(x), x.reshape(1, rows, x.shape[-1])
            y = torch.empty(rows, self.down.out_features, dtype=x.dtype)
            with feeding_prompt(role):
                for i in range(0, rows, PIECE_ROWS):
                    y[i : i + PIECE_ROWS] = self._glu(flat[:, i : i + PIECE_ROWS])[0]
            return y.view(*x.shape[:-1], -1)
        return self._glu(x)

    def _glu(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        out = None
        if self.gate_up.kernel == "quant" and rows > 1 and x.dtype == torch.float32:
            # a prompt's gate|up product is dead once SwiGLU has read it: one reused buffer
            # (a fresh one over glibc's 32 MiB mmap limit, 512 rows x 17,920 at 1.5B, was
            # mapped, faulted in and zeroed by the OS per layer: 30% of the product's time)
            out = _transient(rows * self.gate_up.out_features).view(rows, -1)
        gu = self.gate_up(x, out=out)
        silu = self.act == "silu"
        lib = kernels.library() if silu and gu.is_cpu and gu.dtype == torch.float32 else None
        if lib is not None and gu.is_contiguous() and gu.numel():
            # one pass in C, the fused decode step's own silu_mul (torch's silu on the
            # strided half and the product: ~1 G elements/s in a prompt)
            act = torch.empty(*gu.shape[:-1], gu.shape[-1] // 2)
            rc = lib.kvlm_silu_mul(gu.data_ptr(), gu.numel(), rows, act.shape[-1], act.data_ptr(),
                                   act.numel())  # fmt: skip
            if rc != 0:
                raise ValueError(f"the kernels refused SwiGLU of {rows} rows of "
                                 f"{gu.shape[-1]}")  # fmt: skip
            return self.down(act)
        return self.down(gated(gu, self.act, self.swiglu))


def gated(gu: torch.Tensor, act: str, swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """The gated MLP's activation of its gate|up product gu (..., 2 I) -> (..., I) in
    torch's ops (MLP's `act` and `swiglu`; the CPU's fp32 SwiGLU runs the kernels' instead):
    MLP's and the experts' device road's (kvlm.model.experts) one copy."""
    gate, up = gu.chunk(2, dim=-1)
    if act == "clamped_swiglu":  # its alpha and limit the config's (Experts)
        return clamped_swiglu(gate, up, *swiglu)
    gate = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return gate * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float):
    """An expert's clamped SwiGLU (kvlm.config.EXPERT_ACTIVATIONS), transformers' order of
    operations: gate clamped to at most `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
