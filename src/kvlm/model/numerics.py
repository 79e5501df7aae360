"""How a model's products and prompt attention round: given to the Transformer when it is
built, and by it to each layer it makes (kvlm.defaults resolves the settings from the
file and the CPU; the runner reads them off the model)."""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_DTYPES = ("fp32", "bf16", "int8")
ACTIVATIONS = ("fp32", "int8", "int16")


@dataclass(frozen=True, slots=True)
class ModelNumerics:
    """`prefill_dtype`: prompt rows' low-bit products in fp32, bf16 or on int8 activations;
    `activations`: decoded rows' low-bit products on fp32, int8, or int16 activations (int8
    codes and an int8 residual); `attention_bf16_from`: prompt rows at this position or
    later attend in bf16 on the CPU (0: all; None: none). The vocabulary projection keeps
    fp32 products whatever these say (`Linear.vocabulary`)."""

    prefill_dtype: str = "fp32"
    activations: str = "fp32"
    attention_bf16_from: int | None = None

    def __post_init__(self) -> None:
        if self.prefill_dtype not in PREFILL_DTYPES:
            raise ValueError(f"prefill_dtype {self.prefill_dtype!r}: one of {PREFILL_DTYPES}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations {self.activations!r}: one of {ACTIVATIONS}")

    @property
    def prompt_like_decode(self) -> bool:
        """Whether prompt and decoded rows round alike, so one forward may hold both (a
        ragged step): no bf16 prompt products, int8 activations for both or for neither,
        no int16 decode activations (which prompts never take)."""
        int8 = self.activations in ("int8", "int16")
        return (
            self.prefill_dtype != "bf16"
            and (self.prefill_dtype == "int8") == int8
            and self.activations != "int16"
        )
