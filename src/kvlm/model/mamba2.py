"""The Mamba2 layer: a mixer beside attention (kvlm.config.MIXERS "mamba2"; the
recurrent layers of the Mamba2 hybrids), computed as transformers' reference computes it
(its Mamba2 mixers' torch path, n_groups and the gated group norm). For the block's
normed input x
(B, T, H), with `heads` heads of `head_dim` channels, B and C in `groups` groups of N
(`state_size`; ModelConfig.mamba2):

    z | xBC | dt = in_proj(x)          inner | inner + 2 G N | heads   (inner = heads x head_dim)
    xBC = silu(causal depthwise conv of L positions over xBC + its bias)
    x | B | C = xBC                    x per head; B, C per group (head h reads group
                                       h // (heads / G))
    dt = softplus(dt + dt_bias); A = -exp(A_log)                  (per head)
    per token t, per head h, the state S (head_dim, N):
        S = S * exp(dt A) + x (x) (dt B);   y = S C + D x
    y = rmsnorm over each group's inner / G channels of (y * silu(z)), times w
    out = out_proj(y)

The recurrence runs token by token as transformers' decode path (its
`mamba2_selective_state_update`) does; its prefill takes the chunked scan, the same
mathematics in another order. The state, the gate and the norm run in fp32 (fp64 for an
fp64 model), as transformers runs them in fp32. In fp32 on the CPU with the kernels
built, everything after the convolution is one C call (kernels/mamba2.c, `kvlm_mamba2`):
each value computed one way wherever it falls in a step (a prompt in chunks is its one
shot, a batch row the row alone, bit for bit, as kvlm.model.deltanet's kernel); the torch
ops below are the road for fp64 and other devices. transformers clamps dt to
`time_step_limit` in its prefill and not in its decode; kvlm takes the default limits
alone (0, inf), where both are the same.

What a Mamba2 layer keeps of a sequence is what a gated DeltaNet's is, in its own sizes:
the last L - 1 rows of x|B|C before the convolution and the state S (heads, head_dim, N),
the layer kind RecurrentState (kvlm.cache.kinds.recurrent_state), held by
kvlm.cache.recurrent as the model's recurrent layers' group (DeltaRows, StateSlots: the
same step protocol, `initial`, `stage`, `keep_rows` / `stage_kept`, `conv.taps`, `cu`).
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from kvlm import kernels
from kvlm.cache.kinds import state_dtype
from kvlm.cache.recurrent import DeltaStep, KernelCall
from kvlm.config import Mamba2
from kvlm.model.conv import depthwise
from kvlm.model.layers import Linear


class Mamba2Mixer(nn.Module):
    """A Mamba2 layer (the module docstring): `slot` its index among the model's recurrent
    layers, `in_proj` z | xBC | dt as one product, `kernel` (conv_width, L) the depthwise
    convolution's weights and `conv_bias` (conv_width,) or None, `a_log`, `dt_bias` and
    `d` (heads,), `norm` (inner,) the gated group norm's weight."""

    def __init__(
        self, slot: int, shape: Mamba2, in_proj: Linear, kernel: torch.Tensor,
        conv_bias: torch.Tensor | None, a_log: torch.Tensor, dt_bias: torch.Tensor,
        d: torch.Tensor, norm: torch.Tensor, eps: float, out_proj: Linear,
    ) -> None:  # fmt: skip
        super().__init__()
        self.slot, self.shape, self.eps = slot, shape, eps
        self.in_proj, self.out_proj = in_proj, out_proj
        self.kernel = nn.Parameter(kernel.t().contiguous(), requires_grad=False)  # (L, C)
        self.conv_bias = None if conv_bias is None else nn.Parameter(conv_bias, requires_grad=False)
        self.a_log = nn.Parameter(a_log, requires_grad=False)
        self.dt_bias = nn.Parameter(dt_bias, requires_grad=False)
        self.d = nn.Parameter(d, requires_grad=False)
        self.norm = nn.Parameter(norm, requires_grad=False)

    def forward(self, x: torch.Tensor, step: DeltaStep) -> torch.Tensor:
        """x (B, T, H), the block's normed input -> (B, T, H), the step's sequences as
        GatedDeltaNet.forward takes them (B of T, `step.cu`, or a draft's (n, 1, H))."""
        if step.conv.draft:
            return self._mix(x.transpose(0, 1), step).transpose(0, 1)
        return self._mix(x, step)

    def _mix(self, x: torch.Tensor, step: DeltaStep) -> torch.Tensor:
        s, (B, T, _) = self.shape, x.shape
        z, xbc, dt = self.in_proj(x).split([s.inner, s.conv_width, s.heads], dim=-1)
        conv = depthwise(step.conv.taps(self.slot, xbc), self.kernel, self.conv_bias)
        cu = step.cu if step.cu is not None else [i * T for i in range(B + 1)]
        rows = [t.reshape(B * T, -1) for t in (conv, z, dt)]
        lib = kernels.library() if x.dtype == torch.float32 and x.is_cpu else None
        if lib is not None:  # every value one way wherever it falls (kernels/mamba2.c)
            out = self._kernel(lib, *rows, step, cu)
        else:
            out = self._torch(*rows, step, cu)
        return self.out_proj(out.view(B, T, s.inner))

    def _torch(self, conv, z, dt, step: DeltaStep, cu: list[int]) -> torch.Tensor:
        """The step after the convolution in torch ops (fp64, other devices), a sequence
        at a time: rows (N, .) -> (N, inner), each sequence's state staged."""
        s, dtype = self.shape, conv.dtype
        work, initial = state_dtype(dtype), step.initial(self.slot)
        per = s.heads // s.groups
        a = -self.a_log.to(work).exp()
        out, states, snaps = [], [], []
        points = step.keep_rows or []
        for i, (r0, r1) in enumerate(pairwise(cu)):
            T = r1 - r0
            xbc = F.silu(conv[r0:r1])
            xs, b, c = xbc.split([s.inner, s.groups * s.state_size, s.groups * s.state_size], -1)
            xs = xs.view(T, s.heads, s.head_dim).to(work)
            b, c = (t.view(T, s.groups, s.state_size).repeat_interleave(per, dim=1).to(work)
                    for t in (b, c))  # fmt: skip
            dts = F.softplus(dt[r0:r1].to(work) + self.dt_bias.to(work))  # (T, heads)
            state = initial[i].to(work)
            y = xs.new_empty(T, s.heads, s.head_dim)
            for t in range(T):  # transformers' selective_state_update, a token at a time
                da = torch.exp(dts[t] * a)[:, None, None]
                dbx = (dts[t][:, None] * b[t])[:, None, :] * xs[t][..., None]
                state = state * da + dbx
                y[t] = (state @ c[t][..., None])[..., 0] + xs[t] * self.d.to(work)[:, None]
                if r0 + t in points:
                    snaps.append(state)
            states.append(state)
            out.append(self._gated_norm(y.reshape(T, s.inner), z[r0:r1], work).to(dtype))
        step.stage(self.slot, torch.stack(states))
        if points:
            step.stage_kept(self.slot, torch.stack(snaps))
        return torch.cat(out)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor, work: torch.dtype) -> torch.Tensor:
        """transformers' gated group RMSNorm (norm_before_gate False): y times
        silu(z), normed over each group's channels, in `work`; times the weight in the
        model's dtype."""
        s = self.shape
        h = y.to(work) * F.silu(z.to(work))
        g = h.view(-1, s.groups, s.inner // s.groups)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm.to(z.dtype) * g.view(h.shape).to(z.dtype)

    def _kernel(self, lib, conv, z, dt, step: DeltaStep, cu: list[int]) -> torch.Tensor:
        """The step after the convolution in C (kvlm_mamba2): silu, dt, the state over
        each sequence's tokens (staged as the torch road's), D, the gate and the group
        norm: rows (N, .) -> (N, inner)."""
        s = self.shape
        # conv and z are this step's own (the convolution's output, z's part of in_proj's):
        # the kernel overwrites them with their silu
        conv, z, dt = (t.contiguous() for t in (conv, z, dt))
        call = KernelCall(step, self.slot, cu, torch.empty(conv.shape[0], s.inner))
        params = [p.detach().to(torch.float32).contiguous()
                  for p in (self.a_log, self.dt_bias, self.d, self.norm)]  # fmt: skip
        rc = lib.kvlm_mamba2(
            conv.data_ptr(), conv.numel(), z.data_ptr(), z.numel(), dt.data_ptr(), dt.numel(),
            params[0].data_ptr(), params[1].data_ptr(), params[2].data_ptr(), s.heads,
            params[3].data_ptr(), s.inner, self.eps, *call.args(), s.heads, s.head_dim,
            s.state_size, s.groups,
        )  # fmt: skip
        return call.staged(rc, lambda: (
            f"the kernels refused a Mamba2 step of {len(cu) - 1} sequences, "
            f"{conv.shape[0]} rows ({s.heads} heads of {s.head_dim}, state "
            f"{s.state_size}, {s.groups} groups)"))  # fmt: skip
