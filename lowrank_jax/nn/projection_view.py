"""The matrix view of a projection's kernel: contracted axes as rows, free axes as columns.

:class:`ProjectionView` reads an einsum equation (input first, kernel second) and the kernel's
shape, and turns a kernel into its ``[in, out]`` matrix and back. It is the geometry half of the
projection protocol; :mod:`lowrank_jax.nn.projection` (which re-exports it) finds the modules.
"""

from __future__ import annotations

import dataclasses
import math
import string

import jax.numpy as jnp
import numpy as np


def _tokens(spec: str) -> list[str]:
    """``'...BD'`` -> ``['...', 'B', 'D']`` (``...`` is one token)."""
    out, i = [], 0
    while i < len(spec):
        if spec.startswith("...", i):
            out.append("...")
            i += 3
        else:
            out.append(spec[i])
            i += 1
    return out


@dataclasses.dataclass(frozen=True)
class ProjectionView:
    """A projection's kernel seen as a matrix ``[in, out]``, and the einsums of its adapter.

    Attributes:
        equation: the einsum ``'<x>,<kernel>-><out>'`` (spaces removed; ``...`` allowed in the
            input and output, not in the kernel).
        kernel_shape: the kernel's shape.
        in_axes: kernel axes contracted with the input, in the input's order.
        out_axes: kernel axes kept in the output, in the output's order.
    """

    equation: str
    kernel_shape: tuple[int, ...]
    in_axes: tuple[int, ...]
    out_axes: tuple[int, ...]

    @classmethod
    def from_equation(cls, equation: str, kernel_shape, where: str = "") -> "ProjectionView":
        """Parse ``equation`` for a kernel of ``kernel_shape``; a clear ``ValueError`` when the
        einsum is not a projection (a kernel axis that is also a batch axis, a summed-out kernel
        axis, a kernel with ``...``, a shape that does not fit)."""
        eq = equation.replace(" ", "")
        kernel_shape = tuple(int(s) for s in kernel_shape)
        try:
            lhs, out = eq.split("->")
            xs, ks = lhs.split(",")
        except ValueError:
            raise ValueError(f"{where}einsum {equation!r} must read '<input>,<kernel>-><output>' "
                             "(two operands, explicit output).") from None
        x_t, k_t, o_t = _tokens(xs), _tokens(ks), _tokens(out)
        if "..." in k_t:
            raise ValueError(f"{where}einsum {equation!r}: the kernel operand may not hold '...'.")
        if len(k_t) != len(kernel_shape) or len(set(k_t)) != len(k_t):
            raise ValueError(f"{where}einsum {equation!r} names {len(k_t)} kernel axes but the "
                             f"kernel has shape {kernel_shape}.")
        shared = [c for c in k_t if c in x_t and c in o_t]
        if shared:
            raise ValueError(
                f"{where}einsum {equation!r}: kernel axes {shared} are batch axes (in the input, "
                "the kernel and the output), e.g. per-head weights; that is not one projection "
                "[in, out]. Register a custom view with lowrank_jax.nn.register_projection or "
                "leave this module out of the rule.")
        lost = [c for c in k_t if c not in x_t and c not in o_t]
        if lost:
            raise ValueError(f"{where}einsum {equation!r}: kernel axes {lost} are summed out; "
                             "that is not a projection.")
        dropped = [c for c in x_t if c != "..." and c not in k_t and c not in o_t]
        if dropped:
            raise ValueError(f"{where}einsum {equation!r}: input axes {dropped} are summed out "
                             "without the kernel; that is not a projection.")
        in_axes = tuple(k_t.index(c) for c in x_t if c in k_t)
        out_axes = tuple(k_t.index(c) for c in o_t if c in k_t)
        if not in_axes or not out_axes:
            raise ValueError(f"{where}einsum {equation!r} contracts no input axis or keeps no "
                             "kernel axis; that is not a projection.")
        return cls(eq, kernel_shape, in_axes, out_axes)

    # ------------------------------------------------------------------ the matrix view
    @property
    def in_shape(self) -> tuple[int, ...]:
        """Sizes of the contracted axes, in the input's order."""
        return tuple(self.kernel_shape[a] for a in self.in_axes)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """Sizes of the free axes, in the output's order."""
        return tuple(self.kernel_shape[a] for a in self.out_axes)

    @property
    def in_features(self) -> int:
        """Rows of the matrix view (product of :attr:`in_shape`)."""
        return int(math.prod(self.in_shape))

    @property
    def out_features(self) -> int:
        """Columns of the matrix view (product of :attr:`out_shape`)."""
        return int(math.prod(self.out_shape))

    def to_matrix(self, kernel):
        """A kernel of this layout regrouped as the matrix ``[in, out]`` (a transpose and a
        reshape, no copy of values; a module's weight is :func:`dense_matrix`)."""
        return jnp.transpose(kernel, self.in_axes + self.out_axes).reshape(
            self.in_features, self.out_features)

    def to_kernel(self, matrix):
        """Inverse of :meth:`to_matrix`: a matrix ``[in, out]`` back in the kernel's layout."""
        perm = self.in_axes + self.out_axes
        grouped = jnp.reshape(matrix, tuple(self.kernel_shape[a] for a in perm))
        return jnp.transpose(grouped, tuple(int(i) for i in np.argsort(perm)))

    # ------------------------------------------------------------------ adapter einsums
    def _parts(self):
        lhs, out = self.equation.split("->")
        xs, ks = lhs.split(",")
        x_t, k_t, o_t = _tokens(xs), _tokens(ks), _tokens(out)
        batch = [c for c in x_t if c not in k_t]
        contracted = [c for c in x_t if c in k_t]
        free = [c for c in o_t if c in k_t]
        used = set(self.equation)
        rank = next(c for c in string.ascii_letters[::-1] if c not in used)
        return x_t, o_t, batch, contracted, free, rank

    def apply_factors(self, x, a, b):
        """``unflat(flat(x) @ a @ b)`` without forming ``a @ b``: ``a`` ``[in, r]``, ``b``
        ``[r, out]`` over the matrix view's grouped axes."""
        x_t, o_t, batch, contracted, free, r = self._parts()
        rank = a.shape[-1]
        a = jnp.reshape(a, self.in_shape + (rank,))
        b = jnp.reshape(b, (rank,) + self.out_shape)
        h = jnp.einsum(f"{''.join(x_t)},{''.join(contracted)}{r}->{''.join(batch)}{r}", x, a)
        return jnp.einsum(f"{''.join(batch)}{r},{r}{''.join(free)}->{''.join(o_t)}", h, b)

    def apply_kernel(self, x, kernel):
        """The projection itself, ``einsum(equation, x, kernel)``."""
        return jnp.einsum(self.equation, x, kernel)

    def flatten_input(self, x):
        """``x`` with its batch axes first and its contracted axes flattened: ``[..., in]``."""
        x_t, _, batch, contracted, _, _ = self._parts()
        moved = jnp.einsum(f"{''.join(x_t)}->{''.join(batch)}{''.join(contracted)}", x)
        return moved.reshape(moved.shape[:moved.ndim - len(contracted)] + (self.in_features,))

    def unflatten_output(self, y):
        """Inverse of :meth:`flatten_input` on the output side: ``[..., out]`` -> the output."""
        _, o_t, batch, _, free, _ = self._parts()
        y = y.reshape(y.shape[:-1] + self.out_shape)
        return jnp.einsum(f"{''.join(batch)}{''.join(free)}->{''.join(o_t)}", y)

    def bias_shape(self, ndim_out: int) -> tuple[int, ...]:
        """How a bias of shape :attr:`out_shape` broadcasts onto an output of ``ndim_out`` axes
        (1 on every axis that is not a kernel axis)."""
        _, o_t, _, _, free, _ = self._parts()
        if "..." in o_t:
            extra = ndim_out - (len(o_t) - 1)
            o_t = [c for t in o_t for c in ([t] * extra if t == "..." else [t])]
        return tuple(self.kernel_shape[self.kernel_axis(c)] if c in free else 1 for c in o_t)

    def kernel_axis(self, letter: str) -> int:
        """The kernel axis that ``letter`` names."""
        return _tokens(self.equation.split("->")[0].split(",")[1]).index(letter)


__all__ = ["ProjectionView"]
