"""Pacing: how many prompt tokens a step takes while streams decode.

Every decoding stream waits for the whole step, and a step feeds up to `prefill_chunk`
prompt tokens beside the decode rows. What those tokens cost varies tenfold: a 256-token
chunk of a fresh prompt is ~0.15 s on the default model (2 cores), the same chunk at
position 3,300 of a prompt whose logprobs are asked for (attention over the whole prefix,
the vocabulary projection of every row) 1.8 s on a Zen 3, and more when the machine is
shared. A stream saw its next token that much later (the soak of [18]). Sarathi-Serve's
stall-free batching sizes a step's prompt tokens from the time between tokens a step may
cost; vLLM bounds the same in tokens set by hand (max_num_batched_tokens). Here the bound
is time: a step with decode rows takes the prompt tokens that fit in what the decode rows
leave of `SchedulerConfig.step_time` seconds, and at least half of it (where decoding
alone fills the time, prompts still move on, not at MIN_TOKENS a step), from costs
measured as the engine runs:

- a prompt token's work in units from the model's shape (`Pacing.units`): 1 for its
  dense products, `attend` more per position it attends to, `score` more when every row's
  logits are kept (prompt logprobs);
- the seconds of a step of decode rows alone, and the seconds per unit of prompt work:
  moving averages over the steps (a step with prompt tokens gives the second, less the
  decode rows' share), so a slower CPU, a busier machine or a costlier kernel road is
  measured, not assumed.

While no stream decodes nobody waits: a step takes the whole `prefill_chunk`. A paced step
still takes MIN_TOKENS (a prompt always moves on). A row's bits follow its position, never
its chunk (DESIGN 5): pacing changes when a prompt's tokens run, never its answer.
"""

from __future__ import annotations

import math

from kvlm.config import ModelConfig

MIN_TOKENS = 32  # prompt tokens a paced step still takes
SMOOTH = 0.25  # weight of the newest step in the moving averages


class Work:
    """A step's work in units from the model's shape: 1 a token for its dense products,
    `attend` more per position it attends to, `score` more where its logits are kept. The
    pacing's prompt tokens and the thread count's decode steps (kvlm.engine.threads) are
    measured in it. A short-convolution layer (ModelConfig.conv_layers) attends to
    nothing: its products (in_proj to 3 x hidden, out_proj) and its taps are its work; a
    gated DeltaNet layer (ModelConfig.deltanet_layers) neither: its products (in_proj to
    q|k|v, z, b and a; out_proj) and its state's update, a fixed cost a token (about four
    multiply-adds an element of the value heads' dk x dv state); a Mamba2 layer
    (ModelConfig.mamba2_layers) alike (in_proj to z|x|B|C|dt, out_proj, about three an
    element of its heads' head_dim x N state). A gated attention layer's q product is twice
    as wide (ModelConfig.attn_output_gate: the gate's rows)."""

    def __init__(self, config: ModelConfig) -> None:
        c = config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        # multiply-adds of one token's dense products: q/k/v/o of an attention layer, the
        # products and L taps of a conv layer, a DeltaNet layer's products and state, a
        # gated MLP every layer
        h, convs, deltas = c.hidden_size, len(c.conv_layers), len(c.deltanet_layers)
        mambas = len(c.mamba2_layers)
        attending = c.num_layers - convs - deltas - mambas
        q_rows = 2 * q if c.attn_output_gate else q
        delta = 0
        if deltas and (d := c.deltanet) is not None:
            v = d.value_heads * d.value_dim
            delta = (h * (d.conv_width + v + 2 * d.value_heads) + v * h
                     + 4 * d.value_heads * d.key_dim * d.value_dim)  # fmt: skip
        mamba = 0
        if mambas and (m := c.mamba2) is not None:
            mamba = (h * (m.inner + m.conv_width + m.heads) + m.inner * h
                     + 3 * m.inner * m.state_size)  # fmt: skip
        dense = (attending * h * (q_rows + q + 2 * kv) + deltas * delta + mambas * mamba
                 + convs * h * (4 * h + (c.conv_kernel or 0))
                 + c.num_layers * 3 * h * c.intermediate_size)  # fmt: skip
        self.attend = 2 * attending * q / dense  # scores and the weighted sum, a position
        self.score = c.vocab_size * h / dense  # the vocabulary projection

    def units(self, start: int, n: int, scored: bool) -> float:
        """The work of feeding `n` tokens from position `start`."""
        mean_seen = start + (n + 1) / 2  # positions each row attends to, on average
        return n * (1 + self.attend * mean_seen + (self.score if scored else 0.0))


class Pacing(Work):
    def __init__(self, config: ModelConfig, step_time: float) -> None:
        super().__init__(config)
        self.step_time = step_time
        self.per_unit: float | None = None  # seconds per unit of prompt work
        self.decode_s: float | None = None  # seconds of a step of decode rows alone

    def record(self, seconds: float, decode_rows: int, units: float) -> None:
        """A step's seconds, its decode rows and the work of its prompt tokens."""
        if units <= 0:
            if decode_rows:
                self.decode_s = _mix(self.decode_s, seconds)
            return
        decode = (self.decode_s or 0.0) if decode_rows else 0.0
        prompt = max(seconds - decode, seconds / 2)  # the decode share, at most half
        self.per_unit = _mix(self.per_unit, prompt / units)

    def budget(self, most: int, probe: list[tuple[int, bool]]) -> int:
        """Prompt tokens a step with decode rows may take, of at most `most`: what fits in
        what the decode rows leave of step_time (at least half of it) at the costliest of
        `probe` (each prompt's next position, whether it is scored), at least MIN_TOKENS.
        Unmeasured yet: `most`."""
        if self.per_unit is None or not probe:
            return most
        # what the decode rows leave of step_time, and never less than half of it: where
        # decoding alone takes the whole time, prompts would crawl (the soak's scored
        # 3,500-token prompt passed its client's 300 s at MIN_TOKENS a step)
        left = max(self.step_time - (self.decode_s or 0.0), self.step_time / 2)
        work = left / self.per_unit
        fits = min(self._tokens(start, scored, work) for start, scored in probe)
        return max(min(most, fits), min(most, MIN_TOKENS))

    def _tokens(self, start: int, scored: bool, work: float) -> int:
        """The most tokens from position `start` whose units() are within `work`: units is
        a n^2 / 2 + b n, so n = (sqrt(b^2 + 2 a work) - b) / a."""
        if work <= 0:
            return 0
        a, b = self.attend, 1 + (self.score if scored else 0.0) + self.attend * (start + 0.5)
        n = work / b if a <= 0 else (math.sqrt(b * b + 2 * a * work) - b) / a
        return int(n)


def _mix(average: float | None, sample: float) -> float:
    return sample if average is None else average + SMOOTH * (sample - average)
