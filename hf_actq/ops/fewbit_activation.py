"""Few-bit activations: exact forward, backward from a ``bits``-bit piecewise-constant derivative.

What autograd keeps per call is the packed code buffer (``ceil(n*bits/8)`` bytes), a 4-byte NaN
flag, and a reference to the module's 2**bits-entry level table; all three go through
``ctx.save_for_backward`` so checkpointing and saved-tensor hooks (CPU offload) manage them.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_actq.fewbit.activations import get_activation, resolve_params
from hf_actq.fewbit.dp import FewBitTable
from hf_actq.fewbit.tables import table_for, validate_bits
from hf_actq.kernels import fewbit_backward, fewbit_forward
from hf_actq.ops.slots import observer
from hf_actq.ops.state import (
    OpState,
    keep_rng_stream,
    once_differentiable,
    set_state,
    state_of,
    wants_backward,
)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SLOTS = ("act",)


class FewBitActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, activation, params, borders, levels, bits):
        # The output exactly PyTorch's on every device (see kernels/fewbit.py), with the codes.
        y, packed, nan_flag = fewbit_forward(x, activation, borders, bits, params)
        ctx.save_for_backward(packed, levels, nan_flag)
        ctx.bits = bits
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        packed, levels, nan_flag = ctx.saved_tensors
        grad_x = fewbit_backward(grad_y, packed, levels, nan_flag, ctx.bits)
        return grad_x, None, None, None, None, None


class PackedInputActivationFunction(torch.autograd.Function):
    """An activation that keeps its input packed with a codec (ALAM's and GACT's way: any
    quantizer) instead of a few-bit code of its derivative; backward differentiates the exact
    activation at the unpacked input. Used where a per-slot setting gives an ``act`` slot a
    codec (the "alam" recipe's ladder of precisions)."""

    @staticmethod
    def forward(ctx, x, state):
        packed = state.pack(x, "act")
        ctx.header = packed.with_tensors(())
        ctx.activation = state.activation
        ctx.save_for_backward(*packed.tensors)
        return state.activation.plain(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x_hat = ctx.header.with_tensors(ctx.saved_tensors).unpack()
        with torch.enable_grad():
            leaf = x_hat.detach().requires_grad_()
            (grad_x,) = torch.autograd.grad(ctx.activation.plain(leaf), leaf, grad_y)
        return grad_x, None


class ActivationTable:
    """One few-bit activation: its spec, parameters and derivative table, with the table's
    tensors on each device they are needed on (fp32 whatever the model's dtype: rounding the
    borders to bf16 would move them)."""

    def __init__(
        self, activation: str, bits: int, params=None, table: FewBitTable | None = None
    ) -> None:
        self.spec = get_activation(activation)
        validate_bits(bits)
        self.params = resolve_params(self.spec, dict(params or {}))
        if table is None:
            table = table_for(self.spec.name, bits, **self.params)
        else:
            _check_table(table, self.spec)
        self.table = table
        self._tensors: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def bits(self) -> int:
        return self.table.bits

    @property
    def exact(self) -> bool:
        return self.spec.exact is not None

    @property
    def param_values(self) -> tuple[float, ...]:
        return tuple(self.params.values())

    def tensors(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(borders, levels)`` as fp32 tensors on ``device``."""
        device = torch.device(device)
        if device not in self._tensors:
            self._tensors[device] = (
                torch.tensor(self.table.borders, dtype=torch.float32, device=device),
                torch.tensor(self.table.levels, dtype=torch.float32, device=device),
            )
        return self._tensors[device]

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return self.spec.forward(x, **self.params)

    def forward_and_codes(self, x: torch.Tensor):
        """``(plain(x), packed codes, NaN flag)``: on a GPU one kernel reads x once for both."""
        borders = self.tensors(x.device)[0]
        return fewbit_forward(x, self.spec.name, borders, self.bits, self.param_values)

    @property
    def kind(self) -> str:
        return "exact" if self.exact else f"error={self.table.error:.4f}"

    def describe(self) -> str:
        return f"{self.spec.name} {self.bits}-bit few-bit ({self.kind})"


def fewbit_activation(
    x: torch.Tensor, activation: str, bits: int = 3, *, table: FewBitTable | None = None, **params
) -> torch.Tensor:
    """Functional form of :class:`FewBitActivation`."""
    return FewBitActivation(activation, bits, table=table, **params)(x)


class FewBitActivation(nn.Module):
    """Drop-in few-bit replacement for a pointwise activation.

    ``activation`` is a name from :data:`hf_actq.fewbit.ACTIVATIONS` or an alias (``"swish"``,
    ``"gelu_pytorch_tanh"``); ``params`` are its parameters (``alpha``, ``negative_slope``, ...).
    ``table`` overrides the shipped table, e.g. one from :func:`hf_actq.fewbit.optimal_table`
    with a normal weight. Activations with a two-valued derivative (ReLU family) always use their
    exact 1-bit table.

    In eval mode, under ``torch.no_grad()`` or for inputs that do not require grad, the module is
    the plain activation and keeps nothing. It holds no parameters or buffers, so swapping it
    into a model leaves the state dict as it was.
    """

    def __init__(
        self,
        activation: str,
        bits: int = 3,
        *,
        table: FewBitTable | None = None,
        **params: float,
    ) -> None:
        super().__init__()
        act = ActivationTable(activation, bits, params, table)
        set_state(self, OpState(plain=act.plain, activation=act))

    @property
    def activation(self) -> str:
        return self.spec.name

    @property
    def spec(self):
        return state_of(self).activation.spec

    @property
    def params(self) -> dict[str, float]:
        return state_of(self).activation.params

    @property
    def table(self) -> FewBitTable:
        return state_of(self).activation.table

    @property
    def bits(self) -> int:
        return state_of(self).activation.bits

    @property
    def borders(self) -> torch.Tensor:
        """The table's borders as an fp32 CPU tensor (ops use a copy on the input's device)."""
        return state_of(self).activation.tensors("cpu")[0]

    @property
    def levels(self) -> torch.Tensor:
        """The table's derivative levels as an fp32 CPU tensor."""
        return state_of(self).activation.tensors("cpu")[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = state_of(self)
        if x.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{type(self).__name__} needs a floating-point input (float32, float16, bfloat16 "
                f"or float64), got {x.dtype}"
            )
        if not wants_backward(self, x):
            keep_rng_stream(self, state.codecs.get("act"))
            return state.plain(x)
        if state.codecs.get("act") is not None:
            y = PackedInputActivationFunction.apply(x, state)
        else:
            act = state.activation
            watcher = observer()
            if watcher is not None:
                watcher.on_fewbit(state.slot_id("act"), x, act)
            borders, levels = act.tensors(x.device)
            y = FewBitActivationFunction.apply(
                x, act.spec.name, act.param_values, borders, levels, act.bits
            )
        if getattr(self, "inplace", False):
            # The stock module (``inplace=True``) writes its input and returns it: so does this,
            # with the same autograd history (an in-place op on x whose gradient is y's).
            return x.copy_(y)
        return y

    def extra_repr(self) -> str:
        state = state_of(self)
        act = state.activation
        params = "".join(f", {k}={v:g}" for k, v in act.params.items())
        if state.codecs.get("act") is not None:
            return f"{act.spec.name!r}, input {state.codecs['act']!r}{params}"
        return f"{act.spec.name!r}, bits={act.bits} ({act.kind}){params}"


def _check_table(table: FewBitTable, spec) -> None:
    if not isinstance(table, FewBitTable):
        raise ValueError(f"table must be a FewBitTable, got {type(table).__name__}")
    if spec.exact is not None:
        raise ValueError(f"{spec.name} uses its exact 1-bit table; do not pass table=")
    if len(table.levels) != 2**table.bits or len(table.borders) != 2**table.bits - 1:
        raise ValueError(
            f"a {table.bits}-bit table needs {2**table.bits} levels and {2**table.bits - 1} "
            f"borders, got {len(table.levels)} and {len(table.borders)}"
        )
    if table.symmetric != (spec.code_mode == "symmetric"):
        raise ValueError(
            f"{spec.name} needs a {'symmetric' if spec.code_mode == 'symmetric' else 'plain'} "
            f"table (symmetric={spec.code_mode == 'symmetric'}), got symmetric={table.symmetric}"
        )


class FewBitGELU(FewBitActivation):
    """``nn.GELU(approximate=...)`` with a few-bit backward."""

    def __init__(self, bits: int = 3, approximate: str = "none", **kwargs) -> None:
        if approximate not in ("none", "tanh"):
            raise ValueError(f'approximate must be "none" or "tanh", got {approximate!r}')
        super().__init__("gelu" if approximate == "none" else "gelu_tanh", bits, **kwargs)


def _fixed(name: str, doc: str):
    def __init__(self, bits: int = 3, **kwargs) -> None:
        FewBitActivation.__init__(self, name, bits, **kwargs)

    namespace = {"__init__": __init__, "__doc__": f"Few-bit {name}.", "__module__": __name__}
    return type(doc, (FewBitActivation,), namespace)


FewBitSiLU = _fixed("silu", "FewBitSiLU")
FewBitQuickGELU = _fixed("quick_gelu", "FewBitQuickGELU")
FewBitSigmoid = _fixed("sigmoid", "FewBitSigmoid")
FewBitTanh = _fixed("tanh", "FewBitTanh")
FewBitSELU = _fixed("selu", "FewBitSELU")
FewBitSoftplus = _fixed("softplus", "FewBitSoftplus")
FewBitMish = _fixed("mish", "FewBitMish")
FewBitELU = _fixed("elu", "FewBitELU")
FewBitCELU = _fixed("celu", "FewBitCELU")
FewBitHardswish = _fixed("hardswish", "FewBitHardswish")
FewBitReLU = _fixed("relu", "FewBitReLU")
FewBitLeakyReLU = _fixed("leaky_relu", "FewBitLeakyReLU")
FewBitReLU6 = _fixed("relu6", "FewBitReLU6")
FewBitHardtanh = _fixed("hardtanh", "FewBitHardtanh")
FewBitHardsigmoid = _fixed("hardsigmoid", "FewBitHardsigmoid")
