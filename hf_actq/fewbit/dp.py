"""Optimal piecewise-constant derivative tables by dynamic programming.

Implements the few-bit paper's App. G (fewbit-backward-icml2023, eqs. 3-5, 9-12): on a grid
``A = t_0 < ... < t_n = B`` keep prefix integrals ``W``, ``FW``, ``F2`` of ``w``, ``f'w`` and
``f'^2 w``; then the cost of one constant piece on ``[t_j, t_i]`` is
``T(j, i) = F2(i) - F2(j) - (FW(i) - FW(j))^2 / (W(i) - W(j))`` in O(1), and
``DP(i, k) = min_j DP(j, k - 1) + T(j, i)`` costs O(n^2 K) time. Rows are processed in blocks, so
memory is O(n) per level (plus the O(nK) int32 back-pointers needed to read the borders back).
One pass up to K = 2**max_bits pieces yields the tables for every smaller power of two.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from hf_actq.fewbit.activations import get_activation, resolve_params

MAX_BITS = 4
_GAUSS_NODES, _GAUSS_WEIGHTS = np.polynomial.legendre.leggauss(5)
_ROW_BLOCK = 256


@dataclass(frozen=True)
class FewBitTable:
    """A piecewise-constant approximation of an activation's derivative.

    ``borders`` holds the ``2**bits - 1`` interior cut points in ascending order (on ``|x|`` when
    ``symmetric``); piece ``c`` covers ``(borders[c-1], borders[c]]`` and the outer pieces extend to
    infinity. ``levels[c]`` is the derivative value used for piece ``c``. ``error`` is the weighted
    L2 error of eqs. 3-5 over the whole ``interval`` (both halves when ``symmetric``).
    """

    activation: str
    bits: int
    borders: tuple[float, ...]
    levels: tuple[float, ...]
    error: float
    symmetric: bool = False
    interval: tuple[float, float] = (-10.0, 10.0)
    weight: str = "uniform"
    num_points: int = 2000
    params: dict[str, float] = field(default_factory=dict)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The approximate derivative at ``x`` (float64 NumPy), for plots and checks."""
        x = np.asarray(x, dtype=np.float64)
        v = np.abs(x) if self.symmetric else x
        codes = np.searchsorted(np.asarray(self.borders), v, side="left")
        return np.asarray(self.levels)[codes]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["borders"], data["levels"] = list(self.borders), list(self.levels)
        data["interval"] = list(self.interval)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> FewBitTable:
        data = dict(data)
        for key in ("borders", "levels", "interval"):
            data[key] = tuple(float(v) for v in data[key])
        return cls(**data)


def optimal_table(
    activation: str | Callable[[np.ndarray], np.ndarray],
    bits: int,
    *,
    interval: tuple[float, float] = (-10.0, 10.0),
    weight: str | Callable[[np.ndarray], np.ndarray] = "uniform",
    num_points: int = 2000,
    symmetric: bool | None = None,
    **params: float,
) -> FewBitTable:
    """The DP-optimal ``bits``-bit table for ``activation`` on ``interval``.

    ``activation`` is a name from :data:`hf_actq.fewbit.ACTIVATIONS` (keyword ``params`` such as
    ``alpha`` go to it) or a float64 derivative ``f'(x)`` as a callable. ``weight`` is "uniform",
    "normal" (standard normal density) or a callable ``w(x) >= 0``; it is zero outside
    ``interval``. ``num_points`` is the number of grid cells over ``interval``: the borders are grid
    points, so a finer grid gets closer to the continuous optimum (the paper's Table 3 values are
    reproduced at ``num_points=1000``, a 0.02 step on [-10, 10]).
    """
    return optimal_tables(
        activation,
        bits=(bits,),
        interval=interval,
        weight=weight,
        num_points=num_points,
        symmetric=symmetric,
        **params,
    )[bits]


def optimal_tables(
    activation: str | Callable[[np.ndarray], np.ndarray],
    bits: tuple[int, ...] = (1, 2, 3, 4),
    *,
    interval: tuple[float, float] = (-10.0, 10.0),
    weight: str | Callable[[np.ndarray], np.ndarray] = "uniform",
    num_points: int = 2000,
    symmetric: bool | None = None,
    **params: float,
) -> dict[int, FewBitTable]:
    """Tables for several bit widths from one DP pass (see :func:`optimal_table`)."""
    bits = tuple(bits)
    for b in bits:
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_BITS:
            raise ValueError(f"bits must be an integer in 1..{MAX_BITS}, got {b!r}")
    if isinstance(num_points, bool) or not isinstance(num_points, int) or num_points < 2**MAX_BITS:
        raise ValueError(f"num_points must be an integer >= {2**MAX_BITS}, got {num_points!r}")
    lo, hi = (float(v) for v in interval)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"interval must be two finite numbers A < B, got {interval!r}")

    if callable(activation):
        name, derivative, resolved = getattr(activation, "__name__", "custom"), activation, {}
        symmetric = bool(symmetric)
    else:
        spec = get_activation(activation)
        if spec.exact is not None:
            raise ValueError(
                f"{spec.name} needs no table: its derivative takes two values, which hf_actq "
                "stores exactly in 1 bit"
            )
        name, resolved = spec.name, resolve_params(spec, params)

        def derivative(x):
            return spec.derivative(x, **resolved)

        if symmetric is None:
            symmetric = spec.code_mode == "symmetric"
    weight_fn, weight_name = _weight_function(weight)

    def w(x):
        return np.where((x >= lo) & (x <= hi), weight_fn(x), 0.0)

    step = (hi - lo) / num_points
    if symmetric:
        # Fold: q(|x|) approximates f' on both halves, so |x| carries w(u) + w(-u).
        half = max(abs(lo), abs(hi))
        grid = np.linspace(0.0, half, max(2**MAX_BITS, round(half / step)) + 1)

        def folded(u):
            return w(u) + w(-u)

        weighted = folded
    else:
        grid = np.linspace(lo, hi, num_points + 1)
        weighted = w

    prefix = _prefix_integrals(derivative, weighted, grid)
    solved = _solve(*prefix, max_pieces=2 ** max(bits), wanted={2**b for b in bits})
    tables = {}
    for b in bits:
        error, cuts = solved[2**b]
        borders, levels = _read_table(grid, cuts, *prefix, derivative)
        tables[b] = FewBitTable(
            activation=name,
            bits=b,
            borders=borders,
            levels=levels,
            error=float(error),
            symmetric=bool(symmetric),
            interval=(lo, hi),
            weight=weight_name,
            num_points=num_points,
            params=resolved,
        )
    return tables


def _weight_function(weight):
    if callable(weight):
        return (lambda x: np.asarray(weight(x), dtype=np.float64)), getattr(
            weight, "__name__", "custom"
        )
    if weight == "uniform":
        return (lambda x: np.ones_like(x)), "uniform"
    if weight == "normal":
        return (lambda x: np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)), "normal"
    raise ValueError(f'weight must be "uniform", "normal" or a callable w(x), got {weight!r}')


def _prefix_integrals(derivative, weight, grid):
    """W, FW, F2 at every grid point (eq. 12), 5-point Gauss-Legendre per cell.

    Gauss nodes lie strictly inside cells, so a jump of f' at a grid point (SELU, ELU at 0) is
    integrated exactly rather than smeared.
    """
    left, right = grid[:-1, None], grid[1:, None]
    nodes = 0.5 * (left + right) + 0.5 * (right - left) * _GAUSS_NODES
    quad = 0.5 * (right - left) * _GAUSS_WEIGHTS
    w = weight(nodes) * quad
    if np.any(w < 0) or not np.all(np.isfinite(w)):
        raise ValueError("weight must be finite and non-negative on the interval")
    f = np.asarray(derivative(nodes), dtype=np.float64)
    if not np.all(np.isfinite(f)):
        raise ValueError("the derivative is not finite everywhere on the interval")

    def cumulative(values):
        return np.concatenate([[0.0], np.cumsum(values.sum(axis=1))])

    return cumulative(w), cumulative(f * w), cumulative(f * f * w)


def _solve(W, FW, F2, *, max_pieces, wanted):
    """DP(i, k) for k <= max_pieces; returns {k: (error, cut indices)} for k in ``wanted``."""
    n = len(W)
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = np.maximum(F2 - np.where(W > 0, FW**2 / W, 0.0), 0.0)
    cost[0] = np.inf  # a piece needs positive length
    back = np.zeros((max_pieces + 1, n), dtype=np.int32)
    results = {}
    if 1 in wanted:
        results[1] = (cost[-1], [])
    cols = np.arange(n)
    for k in range(2, max_pieces + 1):
        new_cost = np.full(n, np.inf)
        for start in range(0, n, _ROW_BLOCK):
            rows = np.arange(start, min(n, start + _ROW_BLOCK))[:, None]
            dw = W[rows] - W[cols]
            with np.errstate(divide="ignore", invalid="ignore"):
                piece = F2[rows] - F2[cols] - np.where(dw > 0, (FW[rows] - FW[cols]) ** 2 / dw, 0.0)
            piece = np.where(cols < rows, np.maximum(piece, 0.0), np.inf)
            total = cost[None, :] + piece
            best = np.argmin(total, axis=1)
            back[k, start : start + len(best)] = best
            new_cost[start : start + len(best)] = total[np.arange(len(best)), best]
        cost = new_cost
        if k in wanted:
            cuts, i = [], n - 1
            for level in range(k, 1, -1):
                i = int(back[level, i])
                cuts.append(i)
            results[k] = (cost[-1], cuts[::-1])
    return results


def _read_table(grid, cuts, W, FW, F2, derivative):
    edges = [0, *cuts, len(grid) - 1]
    levels = []
    for j, i in zip(edges[:-1], edges[1:]):
        dw = W[i] - W[j]
        # A piece with no weight (a callable weight that vanishes) gets f' at its midpoint.
        mid = 0.5 * (grid[i] + grid[j])
        levels.append(
            float((FW[i] - FW[j]) / dw) if dw > 0 else float(derivative(np.array([mid]))[0])
        )
    # Round off linspace noise (-2.3999999999999995): borders are grid points by construction.
    return tuple(round(float(grid[c]), 12) for c in cuts), tuple(levels)
