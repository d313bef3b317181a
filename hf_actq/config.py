"""``ActQConfig``: what ``hf_actq.apply`` compresses and how, validated, with named recipes."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields, replace

from hf_actq.codecs import AverageQuantCodec, SignPreservingCodec, SmaQCodec
from hf_actq.codecs.packed import BLOCK_SIZES, Codec

CODECS = ("uniform", "aq", "blpa", "smaq")
DROPOUT_MODES = ("seed", "mask")
RECIPES = ("fewbit", "uniform", "alam")


@dataclass
class ActQConfig:
    """``ActQConfig(bits=3)``: pointwise activations get a 3-bit few-bit derivative and every
    other targeted slot (linear, norm, gated-MLP and attention inputs) is kept at 3 bits;
    dropout masks are regenerated from a seed (or 1 bit per element with
    ``dropout_mode="mask"``).

    ``bits`` is the average precision of the non-activation slots: 1..8 for "uniform" and
    "blpa"; with ``codec="aq"`` it may be below 1 (0.5 is ALAM's "AQ 0.5-bit": groups of 4 at
    2 bits). ``activation_bits`` defaults to ``bits`` clamped to 1..4.
    """

    bits: float = 3
    codec: str = "uniform"
    activation_bits: int | None = None
    group_size: int | None = None
    block_size: int = 128
    activations: bool = True
    linear: bool = True
    norm: bool = True
    gated_mlp: bool = True
    attention: bool = True
    dropout: bool = True
    dropout_mode: str = "seed"
    skip_modules: list[str] = field(default_factory=list)
    recipe: str | None = None

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, float)):
            raise ValueError(f"bits must be a number, got {self.bits!r}")
        if self.codec not in CODECS:
            raise ValueError(f"codec must be one of {', '.join(CODECS)}, got {self.codec!r}")
        low = 0.0625 if self.codec == "aq" else 1
        if not low <= self.bits <= 8 or (self.codec != "aq" and self.bits != int(self.bits)):
            allowed = "a number in 1/16..8" if self.codec == "aq" else "an integer in 1..8"
            raise ValueError(f"bits must be {allowed} for codec {self.codec!r}, got {self.bits!r}")
        if self.activation_bits is None:
            self.activation_bits = int(min(4, max(1, round(self.bits))))
        if isinstance(self.activation_bits, bool) or self.activation_bits not in (1, 2, 3, 4):
            raise ValueError(
                f"activation_bits must be an integer in 1..4, got {self.activation_bits!r}"
            )
        if self.group_size is not None and self.group_size not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"group_size must be one of 1, 2, 4, 8, 16 or None, got {self.group_size!r}"
            )
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(
                f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, "
                f"got {self.block_size!r}"
            )
        if self.dropout_mode not in DROPOUT_MODES:
            raise ValueError(
                f"dropout_mode must be one of {', '.join(DROPOUT_MODES)}, got {self.dropout_mode!r}"
            )
        if isinstance(self.skip_modules, str):
            self.skip_modules = [self.skip_modules]
        for pattern in self.skip_modules:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"skip_modules: {pattern!r} is not a valid regex ({error})"
                ) from error
        for name in ("activations", "linear", "norm", "gated_mlp", "attention", "dropout"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")

    # Recipes -----------------------------------------------------------------------------------
    @classmethod
    def from_recipe(cls, name: str, **overrides) -> ActQConfig:
        """ "fewbit": few-bit activation derivatives only (the paper's setting; logits unchanged).
        "uniform": every slot at ``bits``-bit stochastic rounding, activations few-bit.
        "alam": average quantization at ``bits`` average (default 1); the adaptive per-slot
        allocation will refine this once it lands."""
        if name == "fewbit":
            base = dict(linear=False, norm=False, gated_mlp=False, attention=False, dropout=False)
        elif name == "uniform":
            base = {}
        elif name == "alam":
            base = dict(codec="aq", bits=1)
        else:
            raise ValueError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
        return cls(**{**base, **overrides, "recipe": name})

    # Dict round trip ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ActQConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown ActQConfig fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)

    def replace(self, **changes) -> ActQConfig:
        return replace(self, **changes)

    # Derived -----------------------------------------------------------------------------------
    def make_codec(self) -> Codec:
        """The codec for non-activation slots."""
        if self.codec == "blpa":
            return SignPreservingCodec(bits=int(self.bits), block_size=self.block_size)
        if self.codec == "smaq":
            return SmaQCodec()
        group = self.group_size
        if self.codec == "aq":
            if group is None:
                # 2-bit codes averaged over enough elements to reach the target (ALAM's choice).
                group = 1 if self.bits >= 2 else min(16, 2 ** round(math.log2(2 / self.bits)))
            bits = max(1, min(8, round(self.bits * group)))
            return AverageQuantCodec(bits=bits, group_size=group, block_size=self.block_size)
        return AverageQuantCodec(
            bits=int(self.bits), group_size=group or 1, block_size=self.block_size
        )

    def skips(self, path: str) -> bool:
        return any(re.search(pattern, path) for pattern in self.skip_modules)
