"""Pointwise activations that few-bit backward supports.

Each activation has two faces:

* ``forward``: the exact PyTorch / HF expression, op for op, so that the few-bit module returns
  bit-identical outputs to the module it replaces (HF's ``NewGELUActivation`` is not
  ``F.gelu(approximate="tanh")`` bit for bit, so each HF formula is kept separately);
* ``derivative``: a float64 NumPy derivative used only offline, by the DP table builder.

How the backward code is formed depends on the derivative's shape (``code_mode``):

* ``"table"``: code = number of table borders strictly below ``x`` (2**b intervals);
* ``"symmetric"``: the derivative is even (sigmoid, tanh), so the 2**b intervals cover ``|x|``
  (paper, Figure 3), which doubles the resolution for the same bits;
* ``"threshold"``: exact 1 bit ``x > border`` (ReLU, LeakyReLU);
* ``"interval"``: exact 1 bit ``lo < x < hi`` (ReLU6, hardtanh, hardsigmoid).

For the DP tables ("table", "symmetric") the comparison is made on ``x`` truncated toward zero
to bfloat16 precision (its top 16 bits; bf16 inputs are unchanged). That moves each border by
less than one bf16 ulp, which changes nothing measurable in the gradient, and makes the code a
function of 16 bits, so the CPU path finds it with one table lookup instead of 2**b comparisons.
The exact modes compare ``x`` itself with the strict inequalities of PyTorch's own backward
kernels (``threshold_backward``, ``hardtanh_backward``, ...), so they give exactly PyTorch's
gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


@dataclass(frozen=True)
class ActivationSpec:
    """One supported activation; ``params`` are its keyword parameters with their defaults."""

    name: str
    forward: Callable[..., torch.Tensor]
    code_mode: str  # "table" | "symmetric" | "threshold" | "interval"
    derivative: Callable[..., np.ndarray] | None = None
    # Name of the shipped table family; activations with the same derivative share one.
    table_name: str | None = None
    # Derivatives with two values are stored exactly in 1 bit: params -> (borders, levels).
    exact: Callable[..., tuple[tuple[float, ...], tuple[float, float]]] | None = None
    params: dict[str, float] = field(default_factory=dict)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    from scipy.special import expit

    return expit(x)


def _d_gelu(x):
    from scipy.special import erf

    return 0.5 * (1.0 + erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(
        2.0 * math.pi
    )


def _d_gelu_tanh(x):
    u = _SQRT_2_OVER_PI * (x + 0.044715 * x**3)
    t = np.tanh(u)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (
        1.0 + 3.0 * 0.044715 * x * x
    )


def _d_quick_gelu(x):
    s = _sigmoid(1.702 * x)
    return s + 1.702 * x * s * (1.0 - s)


def _d_silu(x):
    s = _sigmoid(x)
    return s + x * s * (1.0 - s)


def _d_sigmoid(x):
    s = _sigmoid(x)
    return s * (1.0 - s)


def _d_tanh(x):
    return 1.0 - np.tanh(x) ** 2


def _d_selu(x):
    return np.where(x > 0, _SELU_SCALE, _SELU_SCALE * _SELU_ALPHA * np.exp(np.minimum(x, 0.0)))


def _d_softplus(x, beta=1.0, threshold=20.0):
    return np.where(beta * x > threshold, 1.0, _sigmoid(beta * x))


def _d_mish(x):
    sp = np.logaddexp(0.0, x)
    t = np.tanh(sp)
    return t + x * (1.0 - t * t) * _sigmoid(x)


def _d_elu(x, alpha=1.0):
    return np.where(x > 0, 1.0, alpha * np.exp(np.minimum(x, 0.0)))


def _d_celu(x, alpha=1.0):
    return np.where(x > 0, 1.0, np.exp(np.minimum(x, 0.0) / alpha))


def _d_hardswish(x):
    return np.where(x < -3.0, 0.0, np.where(x > 3.0, 1.0, x / 3.0 + 0.5))


# HF formulas, copied op for op from transformers.activations (rounding happens per op in
# half precision, so any reordering would change the output bits).
def _gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x):
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _gelu_python(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_python_tanh(x):
    return x * 0.5 * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_accurate(x):
    return 0.5 * x * (1 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3))))


def _quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


def _table(name, forward, derivative, table_name=None, symmetric=False, **params):
    mode = "symmetric" if symmetric else "table"
    return ActivationSpec(name, forward, mode, derivative, table_name or name, None, params)


def _exact(name, forward, code_mode, exact, **params):
    return ActivationSpec(name, forward, code_mode, None, None, exact, params)


_SPECS = [
    _table("gelu", lambda x: F.gelu(x), _d_gelu),
    _table("gelu_python", _gelu_python, _d_gelu, "gelu"),
    _table("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), _d_gelu_tanh),
    _table("gelu_new", _gelu_new, _d_gelu_tanh, "gelu_tanh"),
    _table("gelu_fast", _gelu_fast, _d_gelu_tanh, "gelu_tanh"),
    _table("gelu_python_tanh", _gelu_python_tanh, _d_gelu_tanh, "gelu_tanh"),
    _table("gelu_accurate", _gelu_accurate, _d_gelu_tanh, "gelu_tanh"),
    _table("quick_gelu", _quick_gelu, _d_quick_gelu),
    _table("silu", F.silu, _d_silu),
    _table("sigmoid", torch.sigmoid, _d_sigmoid, symmetric=True),
    _table("tanh", torch.tanh, _d_tanh, symmetric=True),
    _table("selu", F.selu, _d_selu),
    _table(
        "softplus",
        lambda x, beta, threshold: F.softplus(x, beta, threshold),
        _d_softplus,
        beta=1.0,
        threshold=20.0,
    ),
    _table("mish", F.mish, _d_mish),
    _table("elu", lambda x, alpha: F.elu(x, alpha), _d_elu, alpha=1.0),
    _table("celu", lambda x, alpha: F.celu(x, alpha), _d_celu, alpha=1.0),
    _table("hardswish", F.hardswish, _d_hardswish),
    _exact("relu", F.relu, "threshold", lambda: ((0.0,), (0.0, 1.0))),
    _exact(
        "leaky_relu",
        lambda x, negative_slope: F.leaky_relu(x, negative_slope),
        "threshold",
        lambda negative_slope: ((0.0,), (negative_slope, 1.0)),
        negative_slope=0.01,
    ),
    _exact("relu6", F.relu6, "interval", lambda: ((0.0, 6.0), (0.0, 1.0))),
    _exact(
        "hardtanh",
        lambda x, min_val, max_val: F.hardtanh(x, min_val, max_val),
        "interval",
        lambda min_val, max_val: ((min_val, max_val), (0.0, 1.0)),
        min_val=-1.0,
        max_val=1.0,
    ),
    _exact("hardsigmoid", F.hardsigmoid, "interval", lambda: ((-3.0, 3.0), (0.0, 1.0 / 6.0))),
]

ACTIVATIONS: dict[str, ActivationSpec] = {spec.name: spec for spec in _SPECS}

# Names used by transformers' ACT2FN and torch.nn for the same functions.
ALIASES = {
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_erf": "gelu",
}


def get_activation(name: str) -> ActivationSpec:
    """The spec for ``name`` (aliases accepted); ValueError naming the allowed values otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"activation must be a string name, got {type(name).__name__}")
    key = ALIASES.get(name.lower(), name.lower())
    if key not in ACTIVATIONS:
        allowed = ", ".join(sorted([*ACTIVATIONS, *ALIASES]))
        raise ValueError(f"unknown activation {name!r}; allowed values: {allowed}")
    return ACTIVATIONS[key]


def resolve_params(spec: ActivationSpec, params: dict[str, float]) -> dict[str, float]:
    """``spec.params`` overridden by ``params``; unknown keys raise ValueError."""
    unknown = set(params) - set(spec.params)
    if unknown:
        allowed = ", ".join(sorted(spec.params)) or "none"
        raise ValueError(
            f"activation {spec.name!r} got unknown parameter(s) {sorted(unknown)}; allowed: {allowed}"
        )
    resolved = {key: float(params.get(key, default)) for key, default in spec.params.items()}
    for key, value in resolved.items():
        if not math.isfinite(value):
            raise ValueError(f"activation parameter {key} must be finite, got {value}")
    if spec.name == "celu" and resolved["alpha"] == 0.0:
        raise ValueError("celu alpha must be non-zero, got 0.0")
    if spec.name == "softplus" and resolved["beta"] <= 0.0:
        raise ValueError(f"softplus beta must be positive, got {resolved['beta']}")
    if spec.name == "hardtanh" and not resolved["min_val"] < resolved["max_val"]:
        raise ValueError(
            f"hardtanh needs min_val < max_val, got {resolved['min_val']} and {resolved['max_val']}"
        )
    return resolved


def activation_of(module) -> tuple[str, dict[str, float]] | None:
    """``(name, params)`` of an activation module (transformers' ACT2CLS classes and torch.nn
    activations), or None when it is not a supported pointwise activation. A subclass counts as
    its base only where it keeps the base's forward and what that forward calls (a scaled or
    clipped GELU is another function: None)."""
    import functools

    from torch import nn
    from transformers import activations as hf

    base = _base_activation_class(module)
    if base is None:
        return None
    if base is nn.GELU:
        return ("gelu" if module.approximate == "none" else "gelu_tanh"), {}
    if base is hf.GELUActivation:
        act = module.act
        if act is F.gelu:
            return "gelu", {}
        if getattr(act, "__func__", None) is hf.GELUActivation._gelu_python:
            return "gelu_python", {}
        return None
    if base is hf.GELUTanh:
        act = module.act
        if (
            isinstance(act, functools.partial)
            and act.func is F.gelu
            and not act.args
            and act.keywords == {"approximate": "tanh"}
        ):
            return "gelu_tanh", {}
        if getattr(act, "__func__", None) is hf.GELUTanh._gelu_tanh_python:
            return "gelu_python_tanh", {}
        return None
    if base in _WITH_PARAMS:
        name, keys = _WITH_PARAMS[base]
        return name, {key: float(getattr(module, key)) for key in keys}
    return _BY_CLASS[base], {}


def _base_activation_class(module) -> type | None:
    """The supported activation class ``module`` is, or derives from without its own forward
    (or any other method of its own but ``__init__`` and ``extra_repr``); None otherwise."""
    _fill_class_tables()
    cls = type(module)
    for base in cls.__mro__:
        if base in _KNOWN_CLASSES:
            break
    else:
        return None
    for klass in cls.__mro__:
        if klass is base:
            return base
        own = {
            name
            for name, value in vars(klass).items()
            if callable(value) and name not in ("__init__", "extra_repr")
        }
        if own:
            return None
    return base


def activation_subclass(module) -> str | None:
    """The supported activation class ``module`` subclasses with a forward of its own (which
    hf_actq leaves stock), or None."""
    _fill_class_tables()
    for base in type(module).__mro__[1:]:
        if base in _KNOWN_CLASSES:
            return None if activation_of(module) is not None else base.__name__
    return None


_WITH_PARAMS: dict = {}
_BY_CLASS: dict = {}
_KNOWN_CLASSES: set = set()


def _fill_class_tables() -> None:
    # Filled on first use: transformers is imported lazily.
    if _KNOWN_CLASSES:
        return
    from torch import nn
    from transformers import activations as hf

    _WITH_PARAMS.update(
        {
            nn.LeakyReLU: ("leaky_relu", ("negative_slope",)),
            nn.ELU: ("elu", ("alpha",)),
            nn.CELU: ("celu", ("alpha",)),
            nn.Softplus: ("softplus", ("beta", "threshold")),
            nn.Hardtanh: ("hardtanh", ("min_val", "max_val")),
        }
    )
    _BY_CLASS.update(
        {
            hf.NewGELUActivation: "gelu_new",
            hf.FastGELUActivation: "gelu_fast",
            hf.AccurateGELUActivation: "gelu_accurate",
            hf.QuickGELUActivation: "quick_gelu",
            hf.SiLUActivation: "silu",
            hf.MishActivation: "mish",
            nn.SiLU: "silu",
            nn.ReLU: "relu",
            nn.ReLU6: "relu6",
            nn.Sigmoid: "sigmoid",
            nn.Tanh: "tanh",
            nn.SELU: "selu",
            nn.Mish: "mish",
            nn.Hardswish: "hardswish",
            nn.Hardsigmoid: "hardsigmoid",
        }
    )
    _KNOWN_CLASSES.update({nn.GELU, hf.GELUActivation, hf.GELUTanh, *_WITH_PARAMS, *_BY_CLASS})
