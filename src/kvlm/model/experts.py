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
             everywhere, so a row routes alone as in any batch)
    w      = p[chosen], divided by (their sum + norm_eps) where the family normalises
             (norm_topk_prob), then times `scale` (routed_scaling_factor)
    (router "topk_softmax": logits (+ the router's bias) -> the top_k of the logits, the
     same ties -> w = softmax over those k logits alone)
    y      = sum over chosen, in ascending expert order, of w_e * MLP_e(x)
             (+ sigmoid(x . g) * MLP_shared(x) where the family has a shared expert)

transformers' sparse MoE blocks of this router compute the same (softmax in fp32, top-k,
the renormalisation, then the experts in ascending order, each one's rows added into zeros),
so the exact path follows its sums term by term; their sigmoid routers (a selection
bias, a scale) compute it in the same order too. Each expert is kvlm's gated MLP over the
rows routed to it (its products' rows are their own: the same bits for a row however many
share the expert), under the numerics of the rows the block was given: decoded rows stay
decoded rows when they are gathered (kvlm.model.layers.feeding_prompt).

Experts in host memory (`host`, --cpu-experts: llama.cpp's --n-cpu-moe) beside a model on
a GPU (or in another dtype on the CPU): the router and the shared expert run where the
model runs; the chosen experts, their weights and the rows (fp32) go to the host once per
layer, each chosen expert runs there on the CPU kernels over its rows (the same bits for a
row in any batch, as on the CPU road), their weighted sum comes back in the model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from kvlm import kernels
from kvlm.config import Experts as ExpertsConfig
from kvlm.model.layers import MLP, Linear, feeding_prompt, prompt_rows

# config.ROUTERS -> kvlm_route's and kvlm_qlayer's `router_kind` (kernels/abi.h)
ROUTER_CODES = {"softmax": kernels.CONSTANTS["ROUTER_SOFTMAX"],
                "sigmoid": kernels.CONSTANTS["ROUTER_SIGMOID"],
                "topk_softmax": kernels.CONSTANTS["ROUTER_TOPK_SOFTMAX"]}  # fmt: skip
# config.EXPERT_ACTIVATIONS ("": the model's own) -> kvlm_qlayer's `exp_act`
EXPERT_ACT_CODES = {"": kernels.CONSTANTS["EXP_ACT_MODEL"],
                    "clamped_swiglu": kernels.CONSTANTS["EXP_ACT_CLAMPED_SWIGLU"]}  # fmt: skip


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
    ) -> None:
        """`host`: the routed experts live in host memory, fp32 or low-bit blocks on the
        CPU, whatever the model's device and dtype. `bias`: the selection bias (count,) in
        the router's dtype, where the config has one."""
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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        order = torch.sort(select, dim=-1, descending=True, stable=True).indices
        chosen = order[:, : c.top_k]
        weights = probs.gather(1, chosen)
        if c.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + c.norm_eps)
        if c.scale != 1.0:
            weights = weights * c.scale
        return chosen, weights

    def kernel_refusal(self) -> str | None:
        """Why the kernels' router and the fused step cannot run this mixture (None: they
        can): they know the routers of ROUTER_CODES (a selection bias and a router bias in
        fp32) and the activations of EXPERT_ACT_CODES (the model's own, or the clamped
        SwiGLU; the experts' biases: the fused step's `_block_why_not`)."""
        if self.config.router not in ROUTER_CODES:
            return f"the router {self.config.router!r}"
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        role, shape = prompt_rows(x), x.shape
        flat = x.reshape(-1, shape[-1])
        with feeding_prompt(role):
            chosen, weights = self.route(flat)
            if self.host:
                # one hop each way: (N, hidden) fp32 and (N, top_k) there, (N, hidden) back
                cpu = torch.device("cpu")
                rows = flat.to(cpu, torch.float32)
                out = self._routed(rows, chosen.to(cpu), weights.to(cpu, torch.float32))
                out = out.to(flat.device, flat.dtype)
            else:
                out = self._routed(flat, chosen, weights.to(x.dtype))
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
