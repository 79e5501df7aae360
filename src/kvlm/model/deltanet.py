"""The gated DeltaNet: a mixer beside attention (kvlm.config.MIXERS "deltanet"; a hybrid's
linear-attention layers), computed as transformers' reference computes it. For
the block's normed input x (B, T, H), with nk q/k heads of dk and nv v heads of dv
(ModelConfig.deltanet):

    q|k|v, z, b, a = in_proj(x)       # in_proj_qkv | in_proj_z | in_proj_b | in_proj_a
    q|k|v = silu(causal depthwise conv of L positions over q|k|v)   (no bias)
    q, k = l2norm(q), l2norm(k) per head; q /= sqrt(dk); each q/k head serves nv / nk
           consecutive v heads
    beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias)     (per v head)
    per token t, per v head, the state S (dk, dv):
        S = S * exp(g_t);  S = S + k_t (x) ((v_t - S^T k_t) * beta_t);  o_t = S^T q_t
    out = out_proj(rmsnorm(o) * w * silu(z))          (the gated RMSNorm, per v head)

The rule runs in chunks of DELTA_CHUNK (16) positions at absolute multiples of 16 from
0 (kernels/deltanet.c, `kvlm_gated_delta`: the WY form transformers' chunked prefill
uses, its products as small matrix products, the state read once a row and written
once a chunk; 1.75x the token loop at 512 tokens, BENCHMARKS 24.12), and everything after
the convolution in fp32 on the CPU is that one C call: silu, the norms, the gates, the
rule, the gated norm, each value computed one way wherever it falls in a step. So that a
step cut anywhere computes the values a step from the chunk's start would, the cache
keeps a DeltaNet layer's state as the state at the chunk start of the sequence's length
beside that chunk's rows since (each row's k, u (the delta), g and the chunk's cumulative
g: `kinds.RecurrentState.window_shape`, "carried rows"): a prompt in chunks is its one
shot, a decode row is the prompt's row and a batch row is the row alone, bit for bit.
The torch ops below are the road for fp64 and other devices: the token loop, exactly
transformers' reference `torch_recurrent_gated_delta_rule`, in the same cache format
(`ChunkRows`: the carried rows replayed onto the chunk's state by the loop's own
operations, each row recorded), each value one way there too.

What a DeltaNet layer keeps of a sequence: the last L - 1 rows of q|k|v before the
convolution (a window like a short convolution's: kvlm.cache.conv's ConvRows, L - 1
rows of conv_width), its state S (nv, dk, dv) at the chunk start and the chunk's carried
rows (nv, DELTA_CHUNK - 1, dk + dv + 2), all fixed per sequence.
kvlm.cache.recurrent's `DeltaRows` holds them for the model's DeltaNet layers and a
batch of sequences (begin/commit as a cache does, fork, snapshot/restore; a rollback only
to a state kept: a draft step keeps the state after each of its rows, `step.keep_rows`);
`Transformer.forward(recurrent=)` takes its step, else the cache step's: every
one-sequence cache but off keeps them as a part of their own (kvlm.cache.recurrent's
StateCache, the layer kind RecurrentState); kv "off" feeds every forward from position 0
with a zero state.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from kvlm import kernels
from kvlm.cache.kinds import DELTA_CHUNK, state_dtype
from kvlm.cache.recurrent import DeltaStep, KernelCall
from kvlm.config import DeltaNet
from kvlm.model.conv import depthwise
from kvlm.model.layers import Linear

L2_EPS = 1e-6  # transformers' l2norm (FLA's)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The recurrence's dtype: fp32, fp64 for an fp64 model (kinds.state_dtype: the
    state's, which DeltaRows keeps)."""
    return state_dtype(dtype)


class GatedDeltaNet(nn.Module):
    """A gated DeltaNet layer (the module docstring): `slot` its index among the model's
    DeltaNet layers, `in_proj` in_proj_qkv | in_proj_z | in_proj_b | in_proj_a as one
    product, `kernel` (conv_width, L) the depthwise convolution's weights, `a_log` and
    `dt_bias` (nv,), `norm` (dv,) the gated RMSNorm's weight (w as stored: not 1 + w)."""

    def __init__(
        self, slot: int, shape: DeltaNet, in_proj: Linear, kernel: torch.Tensor,
        a_log: torch.Tensor, dt_bias: torch.Tensor, norm: torch.Tensor, eps: float,
        out_proj: Linear,
    ) -> None:  # fmt: skip
        super().__init__()
        self.slot, self.shape, self.eps = slot, shape, eps
        self.in_proj, self.out_proj = in_proj, out_proj
        self.kernel = nn.Parameter(kernel.t().contiguous(), requires_grad=False)  # (L, C)
        self.a_log = nn.Parameter(a_log, requires_grad=False)
        self.dt_bias = nn.Parameter(dt_bias, requires_grad=False)
        self.norm = nn.Parameter(norm, requires_grad=False)

    def forward(self, x: torch.Tensor, step: DeltaStep) -> torch.Tensor:
        """x (B, T, H), the block's normed input -> (B, T, H). The step's sequences: B of
        T tokens each, or where `step.cu` says (an engine pool step's rows flattened:
        sequence s the rows cu[s] .. cu[s + 1] - 1 of the B x T); a draft's (n, 1, H) is
        one sequence's n tokens (ConvStep.draft: its convolution reads them as (1, n, H))."""
        if step.conv.draft:
            return self._mix(x.transpose(0, 1), step).transpose(0, 1)
        return self._mix(x, step)

    def _mix(self, x: torch.Tensor, step: DeltaStep) -> torch.Tensor:
        s, (B, T, _) = self.shape, x.shape
        nv, dv = s.value_heads, s.value_dim
        qkv, z, b, a = self.in_proj(x).split([s.conv_width, nv * dv, nv, nv], dim=-1)
        conv = depthwise(step.conv.taps(self.slot, qkv), self.kernel, None)  # window first
        cu = step.cu if step.cu is not None else [i * T for i in range(B + 1)]
        rows = [t.reshape(B * T, -1) for t in (conv, z, b, a)]
        lib = kernels.library() if x.dtype == torch.float32 and x.is_cpu else None
        if lib is not None:  # every value one way wherever it falls (kernels/deltanet.c)
            out = self._kernel(lib, *rows, step, cu)
        else:
            out = self._torch(*rows, step, cu)
        return self.out_proj(out.view(B, T, nv * dv))

    def _torch(self, conv, z, b, a, step: DeltaStep, cu: list[int]) -> torch.Tensor:
        """The step after the convolution in torch ops (fp64, other devices), a sequence
        at a time: rows (N, .) -> (N, nv * dv), each sequence's state at its chunk start
        and its carried rows staged (the cache's format, kernels/deltanet.c's: the rule
        here is the token loop, the carried rows replayed onto the state first)."""
        s, dtype = self.shape, conv.dtype
        nk, nv, dk, dv = s.key_heads, s.value_heads, s.key_dim, s.value_dim
        work, initial = work_dtype(dtype), step.initial(self.slot)
        carried = step.initial_win(self.slot)
        out, states, wins, snaps, wsnaps = [], [], [], [], []
        points = step.keep_rows or []
        for i, (r0, r1) in enumerate(pairwise(cu)):
            T = r1 - r0
            q, k, v = F.silu(conv[r0:r1]).split([nk * dk, nk * dk, nv * dv], dim=-1)
            beta = b[None, r0:r1].sigmoid().to(work)
            g = -self.a_log.to(work).exp() * F.softplus(a[None, r0:r1].to(work)
                                                        + self.dt_bias.to(work))  # fmt: skip
            q, k = (t.view(1, T, nk, dk).repeat_interleave(nv // nk, dim=2).to(work)
                    for t in (q, k))  # fmt: skip
            q, k, v = l2norm(q) / dk**0.5, l2norm(k), v.view(1, T, nv, dv).to(work)
            chunk = ChunkRows(initial[i : i + 1].to(work), carried[i].to(work), step.starts[i])
            kept = [p - r0 for p in points if r0 <= p < r1]
            o = chunk.run(q, k, v, g, beta, kept)
            states.append(chunk.start_state[0])
            wins.append(chunk.window())
            for st, wn in chunk.kept:
                snaps.append(st[0])
                wsnaps.append(wn)
            o = gated_rms_norm(o.to(dtype), z[None, r0:r1].view(1, T, nv, dv), self.norm,
                               self.eps, work)  # fmt: skip
            out.append(o.reshape(T, nv * dv))
        kept_as = initial.dtype  # the cache's
        step.stage(self.slot, torch.stack(states).to(kept_as))
        step.stage_win(self.slot, torch.stack(wins).to(kept_as))
        if points:
            step.stage_kept(self.slot, torch.stack(snaps).to(kept_as))
            step.stage_kept_win(self.slot, torch.stack(wsnaps).to(kept_as))
        return torch.cat(out)

    def _kernel(self, lib, conv, z, b, a, step: DeltaStep, cu: list[int]) -> torch.Tensor:
        """The step after the convolution in C (kvlm_gated_delta): silu, the q/k norms,
        the gates, the rule over each sequence's tokens (its state staged as the torch
        road's), the gated norm: rows (N, .) -> (N, nv * dv)."""
        s = self.shape
        nk, nv, dk, dv = s.key_heads, s.value_heads, s.key_dim, s.value_dim
        conv, z, b, a = (t.contiguous() for t in (conv, z, b, a))
        call = KernelCall(step, self.slot, cu, torch.empty(conv.shape[0], nv * dv), step.starts)
        params = [p.detach().to(torch.float32).contiguous()
                  for p in (self.a_log, self.dt_bias, self.norm)]  # fmt: skip
        rc = lib.kvlm_gated_delta(
            conv.data_ptr(), conv.numel(), z.data_ptr(), z.numel(), b.data_ptr(), b.numel(),
            a.data_ptr(), a.numel(), params[0].data_ptr(), params[1].data_ptr(), nv,
            params[2].data_ptr(), dv, self.eps, *call.args(), nk, nv, dk, dv,
        )  # fmt: skip
        return call.staged(rc, lambda: (
            f"the kernels refused a gated DeltaNet step of {len(cu) - 1} sequences, "
            f"{conv.shape[0]} rows ({nk} q/k heads of {dk}, {nv} v heads of {dv})"))  # fmt: skip


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / |x| over the last dim, as transformers' (FLA's) l2norm computes it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


class ChunkRows:
    """The torch road's rule over one sequence in the cache's format (kernels/deltanet.c's:
    the state at the start of the DELTA_CHUNK-row chunk a position is in, and that chunk's
    rows before it, each its k, u (the delta), g and the chunk's cumulative g): the carried
    rows are replayed onto the chunk's state (the loop's own operations, so the state is
    the one a loop from the chunk start reaches), then the loop goes on, recording each
    row. `start_state` (1, nv, dk, dv), `rows` the current chunk's records, `kept` the
    (state, window) after each kept row, in order."""

    def __init__(self, state: torch.Tensor, window: torch.Tensor, p0: int) -> None:
        self.start_state, self.p = state, p0
        m = p0 % DELTA_CHUNK
        self.shape = window.shape  # (nv, DELTA_CHUNK - 1, dk + dv + 2)
        self.rows = [window[:, r] for r in range(m)]
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def window(self) -> torch.Tensor:
        w = self.start_state.new_zeros(self.shape)
        for r, row in enumerate(self.rows):
            w[:, r] = row
        return w

    def run(self, q, k, v, g, beta, kept: list[int]) -> torch.Tensor:
        """q, k (1, T, nv, dk), v (1, T, nv, dv), g, beta (1, T, nv) -> the outputs (1, T,
        nv, dv); `kept`: rows after which the state is recorded."""
        dk = k.shape[-1]
        state = self.start_state
        for row in self.rows:  # the carried rows onto the chunk's state
            kt, delta, gr = row[:, :dk], row[:, dk:-2], row[:, -2]
            state = state * gr.exp()[None, :, None, None]
            state = state + kt[None].unsqueeze(-1) * delta[None].unsqueeze(-2)
        out = v.new_empty(v.shape)
        for t in range(q.shape[1]):
            out[:, t], delta, state = delta_token(q[:, t], k[:, t], v[:, t], g[:, t],
                                                  beta[:, t], state)  # fmt: skip
            gc = g[0, t] if not self.rows else self.rows[-1][:, -1] + g[0, t]
            self.rows.append(torch.cat([k[0, t], delta[0], g[0, t, :, None], gc[:, None]], -1))
            self.p += 1
            if self.p % DELTA_CHUNK == 0:  # the chunk complete
                self.start_state, self.rows = state, []
            if t in kept:
                self.kept.append((self.start_state, self.window()))
        return out


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """q, k (B, T, nv, dk) (normed, q scaled), v (B, T, nv, dv), g, beta (B, T, nv), state
    (B, nv, dk, dv) -> the outputs (B, T, nv, dv) and the state after the T tokens: token
    by token, each operation as transformers' torch_recurrent_gated_delta_rule does it."""
    out = v.new_empty(v.shape)
    for t in range(q.shape[1]):
        out[:, t], _, state = delta_token(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
    return out, state


def delta_token(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token of the rule: q, k (B, nv, dk), v (B, nv, dv), g, beta (B, nv), state (B,
    nv, dk, dv) -> its output (B, nv, dv), its delta (the u a chunk's carried row keeps)
    and the state after it, each operation as transformers' reference does it."""
    state = state * g.exp()[..., None, None]
    kt = k.unsqueeze(-1)  # (B, nv, dk, 1)
    kv_mem = (state * kt).sum(dim=-2)  # (B, nv, dv)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state = state + kt * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), delta, state


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, work: torch.dtype
) -> torch.Tensor:
    """RMSNorm of x (..., dv) in `work`, times the weight in x's dtype, times silu(gate)
    in `work`, back to x's dtype, as transformers' gated RMSNorm."""
    h = x.to(work)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight.to(x.dtype) * h.to(x.dtype)
    return (h * F.silu(gate.to(work))).to(x.dtype)
