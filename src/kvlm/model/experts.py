"""The FFN kind "experts" (ModelConfig.experts): a router picks `top_k` of `count` gated
MLPs for each token, and the token's output is their outputs weighted by the router.

    logits = x @ router^T                  fp32, each row's bits its own (any batch, any
                                           cut): on the CPU the kernels' router
                                           (kernels/experts.c kvlm_route, the fused step's
                                           too); else a Linear of the vocabulary's road
    p      = softmax(logits)               over every expert (router "softmax"), or
             sigmoid(logits)               each expert's own (router "sigmoid")
    chosen = the top_k of p (+ the selection bias where the layer has one: it chooses,
             never weighs), the lower index first among equal ones (ties broken one way
             everywhere, so a row routes alone as in any batch); group-limited (groups_used
             < groups: the torch road alone) among the experts of the row's groups_used
             best groups, each group scored by its two best selection scores' sum
             ("top2") or its best ("max"), the groups and then the experts chosen by
             torch.topk as transformers chooses them (equal scores go where its topk
             puts them, on the same device)
    w      = p[chosen], divided by (their sum + norm_eps) where the family normalises
             (norm_topk_prob), then times `scale` (routed_scaling_factor), then each
             times its expert's own scale where the router has them (`expert_scale`)
    (a router with an input norm of its own, `router_norm`: x RMSNormed by its weight
     before the logits; the experts beside a dense MLP: the router reads the residual
     stream, the experts their own norm of it, `route_from`)
    (router "topk_softmax": logits (+ the router's bias) -> the top_k of the logits, the
     same ties -> w = softmax over those k logits alone)
    y      = sum over chosen, in ascending expert order, of w_e * MLP_e(x)
             (+ sigmoid(x . g) * MLP_shared(x) where the family has a shared expert)

transformers' sparse MoE blocks of this router compute the same (softmax in fp32, top-k,
the renormalisation, then the experts in ascending order, each one's rows added into zeros),
so the exact path follows its sums term by term; their sigmoid routers (a selection
bias, a scale, groups) compute it in the same order too. Each expert is kvlm's gated MLP
over the rows routed to it (its products' rows are their own: the same bits for a row
however many share the expert), under the numerics of the rows the block was given:
decoded rows stay decoded rows when they are gathered (kvlm.model.layers.feeding_prompt).

Experts in host memory (`host`, --cpu-experts: llama.cpp's --n-cpu-moe) beside a model on
a GPU (or in another dtype on the CPU): the router and the shared expert run where the
model runs; the chosen experts, their weights and the rows (fp32) go to the host once per
layer, each chosen expert runs there on the CPU kernels over its rows (the same bits for a
row in any batch, as on the CPU road), their weighted sum comes back in the model's dtype.

The device road (a GPU's experts, dense in the model's dtype: `Experts.stacks`): every
expert's gate|up stacked once (E, 2 I, H), down (E, H, I), their biases (E, 2 I), (E, H)
where they have them, each expert's Linear a view of its slice (no second copy), and the
routed product with no read on the host, every shape N and top_k's (a CUDA graph holds it):

    a      = the N * top_k assignments, each row's experts in ascending order
    grouped  (`grouped_ok`: CUDA sm90/sm100, bf16, H and I multiples of 16): the assignments
             sorted by expert (stable), each expert's end = searchsorted, and
             torch._grouped_mm over the sorted rows for gate|up and for down
    gather   (else: fp32 or fp64 on a GPU, the CPU's tests): each assignment's expert's
             matrices gathered (w[e]) and one bmm, GATHER_ROWS assignments at a time
    y      = a row's weighted outputs added in ascending expert order, as the loop adds them

A GPU's rows take grouped where it runs, else gather when the step is being captured or
its assignments are at most GATHER_ROWS (a decode step's); else (an eager prompt in fp32)
the loop road, which reads each chosen expert's weights once. The CPU keeps the loop (its
kernels, the fused step) unless `ROAD` names a road (tests).
"""

from __future__ import annotations

import torch
from torch import nn

from kvlm import kernels
from kvlm.config import Experts as ExpertsConfig
from kvlm.model.layers import MLP, Linear, RMSNorm, feeding_prompt, gated, prompt_rows

# config.ROUTERS -> kvlm_route's and kvlm_qlayer's `router_kind` (kernels/abi.h)
ROUTER_CODES = {"softmax": kernels.CONSTANTS["ROUTER_SOFTMAX"],
                "sigmoid": kernels.CONSTANTS["ROUTER_SIGMOID"],
                "topk_softmax": kernels.CONSTANTS["ROUTER_TOPK_SOFTMAX"]}  # fmt: skip
# why kvlm_route and the fused step refuse group-limited routing (the torch road routes it)
GROUPS_REFUSED = "group-limited routing (the kernels' router takes the top k of every expert)"
# config.EXPERT_ACTIVATIONS ("": the model's own) -> kvlm_qlayer's `exp_act`
EXPERT_ACT_CODES = {"": kernels.CONSTANTS["EXP_ACT_MODEL"],
                    "clamped_swiglu": kernels.CONSTANTS["EXP_ACT_CLAMPED_SWIGLU"]}  # fmt: skip
# the device road's product where `grouped_ok` does not hold, or "loop": None picks
# (`Experts.road`); "grouped" or "gather" forces that road wherever the experts are stacked,
# and stacks them on the CPU too (tests: the roads against each other without a GPU)
ROAD: str | None = None
# assignments (rows x top_k) one gathered product takes: its gathered matrices are this many
# experts' (a bound on its buffer), and an eager step of more takes the loop road
GATHER_ROWS = 64


class Experts(nn.Module):
    """A mixture-of-experts FFN: `router` (a Linear of `router_weight`, count x hidden,
    fp32, or an fp64 model's fp64, its products in that dtype) and one gated MLP an
    expert."""

    def __init__(
        self,
        config: ExpertsConfig,
        router: Linear,
        experts: list[MLP],
        router_weight: torch.Tensor,
        shared: MLP | None = None,
        shared_gate: Linear | None = None,
        shared_gate_weight: torch.Tensor | None = None,
        host: bool = False,
        bias: torch.Tensor | None = None,
        router_norm: RMSNorm | None = None,
        expert_scale: torch.Tensor | None = None,
    ) -> None:
        """`host`: the routed experts live in host memory, fp32 or low-bit blocks on the
        CPU, whatever the model's device and dtype. `bias`: the selection bias (count,) in
        the router's dtype, where the config has one. `router_norm` (its weight in the
        router's dtype) and `expert_scale` (count,): where the config has them."""
        super().__init__()
        if len(experts) != config.count or router.out_features != config.count:
            raise ValueError(f"{len(experts)} experts and a router of {router.out_features} "
                             f"for {config.count}")  # fmt: skip
        self.config = config
        self.router, self.router_dtype = router, router_weight.dtype
        # its weights as they are (the fused C step reads them): (count, hidden)
        self.router_weight = router_weight.contiguous()
        self.experts = nn.ModuleList(experts)
        # the shared expert every row runs, and its gate's product (fp32: the vocabulary
        # projection's road), or None
        self.shared, self.shared_gate = shared, shared_gate
        # the gate's weights as they are (the fused C step reads them): (hidden,), or None
        self.shared_gate_weight = shared_gate_weight
        self.host = host
        if config.selection_bias != (bias is not None):
            raise ValueError("a selection bias where the config has none, or none where it has")
        # the selection bias as it is (the fused C step reads it): (count,), or None
        self.bias = None if bias is None else bias.to(self.router_dtype).contiguous()
        if (config.router_norm, config.expert_scale) != (
            router_norm is not None,
            expert_scale is not None,
        ):
            raise ValueError("a router norm or expert scales where the config has none, or "
                             "none where it has")  # fmt: skip
        # the router's input norm and each expert's weight scale (count,), or None
        self.router_norm = router_norm
        self.expert_scale = None if expert_scale is None else expert_scale.to(self.router_dtype)
        # the device road's stacked (gate_up, down, gate_up bias, down bias), or None
        self.stacks = None if host else self._stack()

    def _stack(self) -> tuple | None:
        """Stack the experts' dense weights (and biases) once, each expert's Linear left a
        view of its slice: on a GPU (or where `ROAD` says), with every expert's projection
        a plain [out, in] tensor (kernel "torch") of one dtype, shape and device, and the
        biases on all or none; else None (the loop road)."""
        lins = [[getattr(e, n) for e in self.experts] for n in ("gate_up", "down")]
        first = lins[0][0].weight
        if first.is_cpu and ROAD is None:
            return None
        for part in lins:
            w, b = part[0].weight, part[0].bias
            for lin in part:
                v = lin.weight
                same = (v.dtype, v.shape, v.device) == (w.dtype, w.shape, w.device)
                if lin.kernel != "torch" or not same:
                    return None
                if (lin.bias is None) != (b is None):
                    return None
        e0 = self.experts[0]
        if any((e.act, e.swiglu) != (e0.act, e0.swiglu) for e in self.experts):
            return None
        stacks = []
        for part in lins:
            stacks.append(_stacked(part, "weight"))
        for part in lins:
            stacks.append(None if part[0].bias is None else _stacked(part, "bias"))
        return tuple(stacks)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row of x (N, hidden): its experts (N, top_k) and their weights (N, top_k)
        in the router's dtype: through the router's own input norm first, and each weight
        times its expert's scale last, where it has them (row by row, so around either
        road of `_scores`)."""
        if self.router_norm is not None:
            x = self.router_norm(x.to(self.router_dtype))
        chosen, weights = self._scores(x)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[chosen]
        return chosen, weights

    def _scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row of x (N, hidden): its experts (N, top_k), the higher weight first,
        and their weights (N, top_k) fp32. On the CPU in fp32 the kernels' router
        (kvlm_route: the fused step's own, so both roads route a row alike); else torch's
        (fp64, a GPU, no kernels), the same steps."""
        lib = kernels.library()
        w, c = self.router_weight, self.config
        c_road = self.kernel_refusal() is None
        if c_road and lib is not None and w.dtype == torch.float32 and x.is_cpu and x.numel():
            return self._route_kernel(lib, x.float().contiguous())
        logits = self.router(x.to(self.router_dtype))
        if c.router == "topk_softmax":
            return self._topk_softmax(logits)
        probs = torch.sigmoid(logits) if c.router == "sigmoid" else torch.softmax(logits, dim=-1)
        select = probs if self.bias is None else probs + self.bias.to(probs.device)
        if c.group_limited:
            chosen = self._group_limited(select)
        else:
            chosen = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, : c.top_k]
        weights = probs.gather(1, chosen)
        if c.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + c.norm_eps)
        if c.scale != 1.0:
            weights = weights * c.scale
        return chosen, weights

    def _group_limited(self, select: torch.Tensor) -> torch.Tensor:
        """Each row's top_k experts (N, top_k), the higher selection score first, among
        the experts of its `groups_used` best groups (the others' scores -inf): a group
        scored by its two best scores' sum or its best; transformers' calls (topk(2) and
        its sum, then topk unsorted for the groups and for the experts), so that equal
        scores fall as in its router."""
        c, n = self.config, select.shape[0]
        grouped = select.view(n, c.groups, -1)  # (N, groups, experts a group)
        if c.group_score == "max":
            score = grouped.amax(dim=-1)
        else:
            score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = torch.topk(score, c.groups_used, dim=-1, sorted=False).indices
        keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, best, True)
        select = grouped.masked_fill(~keep[..., None], float("-inf")).view(n, -1)
        top = torch.topk(select, c.top_k, dim=-1, sorted=False)
        order = torch.sort(top.values, dim=-1, descending=True, stable=True).indices
        return top.indices.gather(1, order)

    def kernel_refusal(self) -> str | None:
        """Why the kernels' router and the fused step cannot run this mixture (None: they
        can): they know the routers of ROUTER_CODES (a selection bias and a router bias in
        fp32) over every expert (not group-limited routing) and the activations of
        EXPERT_ACT_CODES (the model's own, or the clamped SwiGLU; the experts' biases: the
        fused step's `_block_why_not`)."""
        if self.config.router not in ROUTER_CODES:
            return f"the router {self.config.router!r}"
        if self.config.group_limited:
            return GROUPS_REFUSED
        if self.router.bias is not None and self.router.bias.dtype != torch.float32:
            return "a router bias not in fp32"
        if self.bias is not None and self.bias.dtype != torch.float32:
            return "a router's selection bias not in fp32"
        if self.config.activation not in EXPERT_ACT_CODES:
            return f"the experts' activation {self.config.activation!r}"
        return None

    def _topk_softmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The "topk_softmax" router: the top k of the logits (ties to the lower expert),
        their weights a softmax over those k alone (transformers' order: top k, then
        softmax in the logits' dtype)."""
        order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
        chosen = order[:, : self.config.top_k]
        return chosen, torch.softmax(logits.gather(1, chosen), dim=-1)

    def router_bias(self) -> torch.Tensor | None:
        """The router's own bias (count,) fp32 as the kernels read it (added to its
        logits after the product, as the router's Linear adds it), or None."""
        b = self.router.bias
        return None if b is None else b.detach().reshape(-1).contiguous()

    def _route_kernel(self, lib, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, (e, h), c = x.shape[0], self.router_weight.shape, self.config
        k, bias, rb = c.top_k, self.bias, self.router_bias()
        chosen = torch.empty(n, k, dtype=torch.int64)
        weights = torch.empty(n, k, dtype=torch.float32)
        logits = torch.empty(n, e, dtype=torch.float32)
        rc = lib.kvlm_route(x.data_ptr(), x.numel(), n, h, self.router_weight.data_ptr(),
                            self.router_weight.numel(), e, k, int(c.normalize),
                            ROUTER_CODES[c.router], None if bias is None else bias.data_ptr(),
                            0 if bias is None else bias.numel(), c.norm_eps, c.scale,
                            chosen.data_ptr(), chosen.numel(), weights.data_ptr(),
                            weights.numel(), logits.data_ptr(), logits.numel(),
                            None if rb is None else rb.data_ptr(),
                            0 if rb is None else rb.numel())  # fmt: skip
        if rc != 0:
            raise ValueError(f"the kernels refused a router of {e} experts over {h}")
        return chosen, weights

    def forward(self, x: torch.Tensor, route_from: torch.Tensor | None = None) -> torch.Tensor:
        """The mixture's output for the rows of x (..., hidden); `route_from` (x's shape):
        the rows the router reads where they are not x (experts beside a dense MLP)."""
        role, shape = prompt_rows(x), x.shape
        flat = x.reshape(-1, shape[-1])
        with feeding_prompt(role):
            routed = flat if route_from is None else route_from.reshape(flat.shape)
            chosen, weights = self.route(routed)
            if self.host:
                # one hop each way: (N, hidden) fp32 and (N, top_k) there, (N, hidden) back
                cpu = torch.device("cpu")
                rows = flat.to(cpu, torch.float32)
                out = self._routed(rows, chosen.to(cpu), weights.to(cpu, torch.float32))
                out = out.to(flat.device, flat.dtype)
            else:
                road = self.road(flat)
                if road == "loop":
                    out = self._routed(flat, chosen, weights.to(x.dtype))
                else:
                    out = self._device(flat, chosen, weights.to(x.dtype), road)
            if self.shared is not None:  # routed + sigmoid(gate) * shared, as transformers
                y = self.shared(flat.unsqueeze(0))[0]
                if self.shared_gate is not None:
                    y = torch.sigmoid(self.shared_gate(flat.to(self.router_dtype))).to(y.dtype) * y
                out = out + y
        return out.view(shape)

    def _routed(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor):
        """The routed experts' weighted outputs (N, hidden) in flat's dtype and device:
        each chosen expert once over its rows, added in ascending expert order."""
        out = torch.zeros_like(flat)
        for e in torch.unique(chosen).tolist():  # ascending (a read on the host: no graph)
            rows, slot = torch.where(chosen == e)
            y = self.experts[e](flat[rows].unsqueeze(0))[0]
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out

    def road(self, flat: torch.Tensor) -> str:
        """Which product the routed experts of `flat` (N, hidden) take: "grouped",
        "gather" or "loop" (the module's docstring)."""
        if self.stacks is None or self.host or not flat.shape[0]:
            return "loop"
        if ROAD is not None:
            return ROAD
        if flat.is_cpu:
            return "loop"
        if grouped_ok(flat, self.stacks[0], self.stacks[1]):
            return "grouped"
        n = flat.shape[0] * self.config.top_k
        capturing = flat.is_cuda and torch.cuda.is_current_stream_capturing()
        return "gather" if capturing or n <= GATHER_ROWS else "loop"

    def _device(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                road: str) -> torch.Tensor:  # fmt: skip
        """The routed experts' weighted outputs (N, hidden) on the stacked weights, with no
        read on the host: "grouped" or "gather" (`road`); a row's terms added in ascending
        expert order, as `_routed` adds them."""
        n, k = chosen.shape
        chosen, slot = torch.sort(chosen, dim=1, stable=True)  # each row's experts ascending
        w = weights.gather(1, slot).reshape(-1, 1)
        ids = chosen.reshape(-1)  # (N k,): assignment a is row a // k's
        rows = torch.arange(n * k, device=flat.device) // k
        if road == "grouped":
            y = self._grouped(flat, ids, rows)
        elif road == "gather":
            y = torch.cat([self._gathered(flat[rows[i : i + GATHER_ROWS]], ids[i : i + GATHER_ROWS])
                           for i in range(0, n * k, GATHER_ROWS)])  # fmt: skip
        else:
            raise ValueError(f"no experts' road {road!r}")
        y = (y * w).view(n, k, -1)
        out = y[:, 0]
        for j in range(1, k):  # ascending expert order, one term at a time
            out = out + y[:, j]
        return out

    def _activation(self, gu: torch.Tensor) -> torch.Tensor:
        e = self.experts[0]
        return gated(gu, e.act, e.swiglu)

    def _gathered(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Assignments' rows x (n, hidden) through their experts `ids` (n,): each one's
        matrices gathered, one bmm (baddbmm with the bias, as a Linear's addmm)."""
        gate_up, down, gate_up_b, down_b = self.stacks
        y = _bmm(x[:, None], gate_up[ids], None if gate_up_b is None else gate_up_b[ids])
        return _bmm(self._activation(y), down[ids], None if down_b is None else down_b[ids])[:, 0]

    def _grouped(self, flat: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor):
        """The assignments (ids (N k,) of rows `rows`) sorted by expert, one grouped product
        for gate|up and one for down over every expert's run of them, back in their order."""
        gate_up, down, gate_up_b, down_b = self.stacks
        ids, order = torch.sort(ids, stable=True)
        experts = torch.arange(gate_up.shape[0], device=ids.device)
        ends = torch.searchsorted(ids, experts, right=True).to(torch.int32)
        x = flat[rows[order]]
        y = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=ends)
        y = self._activation(y if gate_up_b is None else y + gate_up_b[ids])
        y = torch._grouped_mm(y, down.transpose(-2, -1), offs=ends)
        y = y if down_b is None else y + down_b[ids]
        return torch.empty_like(y).index_copy_(0, order, y)


def grouped_ok(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether torch._grouped_mm multiplies these on their device with no read on the host:
    CUDA of compute capability 9 or 10 (its CUTLASS kernels; elsewhere a loop over the
    groups that reads their ends on the host), bf16, every dimension a multiple of 16
    (its 16-byte strides)."""
    if not x.is_cuda or not hasattr(torch, "_grouped_mm"):
        return False
    if {x.dtype, gate_up.dtype, down.dtype} != {torch.bfloat16}:
        return False
    if any(d % 16 for d in (*gate_up.shape[1:], *down.shape[1:])):
        return False
    return torch.cuda.get_device_capability(x.device)[0] in (9, 10)


def _bmm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x (n, 1, in) by each w (n, out, in) transposed, plus b (n, out): (n, 1, out)."""
    if b is None:
        return torch.bmm(x, w.transpose(1, 2))
    return torch.baddbmm(b[:, None], x, w.transpose(1, 2))


def _stacked(lins: list[Linear], name: str) -> torch.Tensor:
    """The Linears' `name` buffer stacked (E, ...); each Linear's becomes a view of it."""
    stack = torch.stack([getattr(lin, name) for lin in lins])
    for lin, view in zip(lins, stack.unbind(0), strict=True):
        setattr(lin, name, view)
    return stack
