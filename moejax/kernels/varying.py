"""Cotangents for hand-written custom VJPs: shard_map varying-axis types (a backward must return cotangents typed
like their primals, summed over the mesh axes the primal is invariant on, as autodiff's own transposes do), and
the float0 cotangent of an integer input."""

from __future__ import annotations

import jax
import numpy as np


def varying(x) -> frozenset:
    return jax.typeof(x).manual_axis_type.varying


def varying_union(*arrays) -> frozenset:
    """The mesh axes any of the arrays varies over."""
    return frozenset().union(*(varying(a) for a in arrays))


def int_cotangent(x):
    """The cotangent of an integer input (sizes, indices, offsets): float0 zeros, no gradient."""
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def mark_varying(y, axes):
    """y typed as varying over `axes`. Inside shard_map, kernels (tokamax's Mosaic GPU calls) can return arrays
    typed as varying over no mesh axis although each device computed its own; only used inside custom VJPs,
    where this mark is never transposed (so it implies no reduction)."""
    missing = tuple(sorted(frozenset(axes) - varying(y)))
    return jax.lax.pcast(y, missing, to="varying") if missing else y


def cotangent(ct, varies_over, primal):
    """A cotangent that truly varies over `varies_over`, summed over the axes the primal is invariant on (the
    transpose of the implicit broadcast that used the primal there) and typed like the primal."""
    ct = mark_varying(ct, varies_over)
    extra = tuple(sorted(varying(ct) - varying(primal)))
    return jax.lax.psum(ct, extra) if extra else ct
