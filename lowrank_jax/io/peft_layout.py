"""Fused kernels in PEFT files: split an adapter over several HF modules, or stack several
adapters into one fused HF module, and the way back.

A kernel *stacked* on its leading free axis (gemma's ``qkv_einsum`` ``'BTD,SNDH->SBTNH'``,
``kv_einsum`` ``'BSD,CKDH->CBSKH'``) holds one adapter ``A [in, r]``, ``B [r, S·N·H]`` whose
``B`` columns are the slices ``[q | k | v]``. Mapped to separate HF modules (a tuple target of
:mod:`~lowrank_jax.io.peft_names`) each module gets ``lora_A = Aᵀ`` and its own slice of ``B``
(rank and alpha unchanged). Mapped to a fused HF module (Phi-3's ``qkv_proj``) it is stored
whole. Separate adapters that are row blocks of one fused HF module are stacked:

.. math:: A_f = \\begin{bmatrix}A_q^\\top\\\\A_k^\\top\\\\A_v^\\top\\end{bmatrix},\\quad
          B_f = \\mathrm{blockdiag}(B_q^\\top, B_k^\\top, B_v^\\top)\\,\\frac{s_i}{s},\\quad
          r_f = \\textstyle\\sum r_i,\\quad \\alpha_f = s\\,r_f

(``s`` the first block's scale, ``√r_f`` instead of ``r_f`` with rsLoRA; a block no adapter
covers is zero), so three rank-r, alpha-α adapters give rank 3r and alpha 3α, the same scale.
Import undoes both: the slices of a stacked kernel sharing one ``lora_A`` become one adapter
again; a fused module's row block keeps the rank components its ``B`` block uses (all of them
when ``B`` is still zero everywhere, an adapter at init). A map that
sends a stacked kernel to one plain HF module is refused: its ``B`` would be 2-3× too wide.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from lowrank_jax.io.peft_names import Target, targets
from lowrank_jax.nn.lora import lora_scaling
from lowrank_jax.nn.projection import ProjectionView, is_projection, projection_view


@dataclasses.dataclass(frozen=True)
class Slot:
    """One projection of the model as a name map sees it: its :class:`Target`\\ s and the
    output width each covers (a stacked kernel splits its width over its slices)."""

    path: str
    targets: tuple[Target, ...]
    widths: tuple[int, ...]
    in_features: int


def stacked_size(view: ProjectionView) -> int:
    """The size of a stacked kernel's leading free axis (the output starts with a kernel axis,
    batch axes follow: ``'SBTNH'``), 1 for an ordinary projection.

    Example::

        >>> view = ProjectionView.from_equation("BTD,SNDH->SBTNH", (3, 2, 8, 4))
        >>> stacked_size(view), stacked_size(ProjectionView.from_equation("BTD,NDH->BTNH",
        ...                                                                (2, 8, 4)))
        (3, 1)
    """
    lhs, out = view.equation.replace("...", ".").split("->")  # "." stands for "..."
    x_t, k_t = lhs.split(",")
    o_t = out
    if o_t and o_t[0] in k_t and any(t == "." or (t in x_t and t not in k_t) for t in o_t[1:]):
        return view.kernel_shape[k_t.index(o_t[0])]
    return 1


def _sizes(module) -> tuple[int, int, int]:
    """``(in, out, stacked)`` of a projection or an adapted layer."""
    view = getattr(module, "view", None)
    if not isinstance(view, ProjectionView) and is_projection(module):
        view = projection_view(module)
    if isinstance(view, ProjectionView):
        return view.in_features, view.out_features, stacked_size(view)
    return int(module.in_features), int(module.out_features), 1


def model_slots(modules, mapper, adapted: set[str]) -> dict[str, Slot]:
    """A :class:`Slot` for every ``(path, module)`` the map names; a path it cannot map is left
    out, unless it is in ``adapted`` (then the map's ``ValueError`` propagates)."""
    slots = {}
    for path, module in modules:
        try:
            found = targets(path, mapper)
        except ValueError:
            if path in adapted:
                raise
            continue
        try:
            in_f, out_f, stacked = _sizes(module)
        except (AttributeError, ValueError):
            if path in adapted:
                raise
            continue  # a layer whose sizes cannot be read is not in the adapter
        if len(found) > 1:
            if stacked != len(found):
                how = "not stacked" if stacked == 1 else f"stacked {stacked} times"
                raise ValueError(
                    f"PEFT name map: {path!r} maps to {len(found)} HF modules "
                    f"{[t.name for t in found]}, but its kernel is {how} on its leading output "
                    "axis; map it to as many HF modules as it stacks.")
            widths = (out_f // stacked,) * stacked
        else:
            if stacked > 1 and not (found[0].parts and found[0].part is None):
                raise ValueError(
                    f"PEFT name map: {path!r} is a fused kernel (its output stacks {stacked} "
                    f"projections on the leading axis) but maps to the one HF module "
                    f"{found[0].name!r}, which would get a lora_B {stacked}x too wide. Map it to "
                    f"a tuple of {stacked} HF names (split), or to "
                    "lowrank_jax.io.peft_names.Fused(name) when the HF model fuses them too "
                    "(name_map='phi3'), or leave it out of the adapter.")
            widths = (out_f,)
        slots[path] = Slot(path, found, widths, in_f)
    return slots


def _part_widths(slots: dict[str, Slot]) -> dict[str, dict[int, int]]:
    widths: dict[str, dict[int, int]] = {}
    for slot in slots.values():
        for target, width in zip(slot.targets, slot.widths):
            if target.part is not None:
                widths.setdefault(target.name, {})[target.part] = width
    return widths


def _alpha(scale: float, rank: int, use_rslora: bool) -> float:
    return scale * (math.sqrt(rank) if use_rslora else rank)


def _check_parts(name, parts, widths):
    missing = [parts[i] for i in range(len(parts)) if i not in widths]
    if missing:
        raise ValueError(
            f"PEFT export: the fused HF module {name!r} has parts {parts} but the model has no "
            f"projection for {missing}; the widths of its rows are unknown. Map that projection "
            "too, or map these modules to separate HF names.")
    return [widths[i] for i in range(len(parts))]


def export_modules(adapters, slots: dict[str, Slot], use_rslora: bool) -> dict:
    """``{hf name: (lora_A [R, in], lora_B [out, R], R, alpha)}`` from ``adapters``, a list of
    ``(path, A [in, r], B [r, out], rank, alpha)`` (numpy), split / stacked as the slots say."""
    pieces: dict[str, list] = {}
    for path, a, b, rank, alpha in adapters:
        slot = slots[path]
        scale = lora_scaling(rank, alpha, use_rslora)
        blocks = ([b] if len(slot.targets) == 1
                  else list(np.moveaxis(b.reshape(rank, len(slot.targets), -1), 1, 0)))
        for target, block in zip(slot.targets, blocks):
            pieces.setdefault(target.name, []).append((target, path, a, block, rank, alpha, scale))
    part_widths = _part_widths(slots)
    out = {}
    for name, group in pieces.items():
        target = group[0][0]
        if target.part is None:
            if len(group) > 1:
                raise ValueError(f"PEFT export: {[g[1] for g in group]} all map to the HF module "
                                 f"{name!r}; give each its own name (or a Fused part).")
            _, _, a, block, rank, alpha, _ = group[0]
            out[name] = (a.T, block.T, rank, alpha)
            continue
        if any(g[0].part is None or g[0].parts != target.parts for g in group):
            raise ValueError(f"PEFT export: the HF module {name!r} is both whole and a fused "
                             "module's part in the name map; fix the map.")
        group.sort(key=lambda g: g[0].part)  # A = [A_q; A_k; A_v] in the module's row order
        target = group[0][0]
        widths = _check_parts(name, target.parts, part_widths.get(name, {}))
        offsets = np.cumsum([0] + widths)
        sources = list(dict.fromkeys(g[1] for g in group))  # each adapter's A once
        first = {g[1]: g for g in reversed(group)}
        ranks = [first[p][4] for p in sources]
        cols = dict(zip(sources, np.cumsum([0] + ranks)))
        total = int(sum(ranks))
        ref = group[0][6]
        lora_a = np.concatenate([first[p][2].T for p in sources], axis=0)
        lora_b = np.zeros((int(offsets[-1]), total), np.float32)
        for tgt, path, _, block, rank, _, scale in group:
            if block.shape[1] != widths[tgt.part]:
                raise ValueError(
                    f"PEFT export: {path!r} gives {block.shape[1]} rows of {name!r} part "
                    f"{tgt.parts[tgt.part]!r}, which has {widths[tgt.part]}.")
            rows = slice(offsets[tgt.part], offsets[tgt.part + 1])
            lora_b[rows, cols[path]:cols[path] + rank] = block.T * (scale / ref)
        out[name] = (lora_a, lora_b, total, _alpha(ref, total, use_rslora))
    return out


def import_modules(modules: dict, slots: dict[str, Slot], use_rslora: bool):
    """Inverse of :func:`export_modules`: ``modules`` ``{hf name: (lora_A [R, in],
    lora_B [out, R], alpha)}`` -> ``({path: (A [in, r], B [r, out], rank, alpha)}, used hf
    names)``."""
    part_widths = _part_widths(slots)
    plan, used = {}, set()
    for path, slot in slots.items():
        pieces = []
        for target, width in zip(slot.targets, slot.widths):
            if target.name not in modules:
                pieces.append(None)
                continue
            used.add(target.name)
            lora_a, lora_b, alpha = modules[target.name]
            rank = lora_a.shape[0]
            scale = lora_scaling(rank, alpha, use_rslora)
            if target.part is not None:
                widths = _check_parts(target.name, target.parts, part_widths[target.name])
                if lora_b.shape[0] != sum(widths):
                    raise ValueError(
                        f"import_peft: {target.name} has lora_B {lora_b.shape}; its parts "
                        f"{target.parts} need {sum(widths)} rows in this model.")
                start = sum(widths[:target.part])
                untrained = not lora_b.any()  # B = 0 everywhere: every block keeps all of A
                lora_b = lora_b[start:start + widths[target.part]]
                keep = (np.arange(rank) if untrained
                        else np.flatnonzero(np.any(lora_b != 0, axis=0)))
                if keep.size == 0:  # this block was not adapted
                    pieces.append(None)
                    continue
                lora_a, lora_b = lora_a[keep], lora_b[:, keep]
            if lora_b.shape[0] != width and len(slot.targets) > 1:  # one: checked by caller
                raise ValueError(
                    f"import_peft: {target.name} has lora_B {lora_b.shape} but {path} gives it "
                    f"{width} rows (lora_B must be [{width}, r]); was the adapter trained on a "
                    "different base model?")
            pieces.append((lora_a, lora_b, scale))
        present = [p for p in pieces if p is not None]
        if not present:
            continue
        ref = present[0][2]
        if len(pieces) == 1 or all(p[0].shape == present[0][0].shape
                                   and np.array_equal(p[0], present[0][0]) for p in present):
            a = present[0][0].T  # one shared A: the B slices side by side
            rank = a.shape[1]
            b = np.concatenate([np.zeros((rank, w), np.float32) if p is None
                                else p[1].T * (p[2] / ref)
                                for p, w in zip(pieces, slot.widths)], axis=1)
        else:  # different A per slice: stack the ranks, block-diagonal B
            rank = sum(p[0].shape[0] for p in present)
            a = np.concatenate([p[0].T for p in present], axis=1)
            b = np.zeros((rank, sum(slot.widths)), np.float32)
            row, offsets = 0, np.cumsum([0] + list(slot.widths))
            for i, p in enumerate(pieces):
                if p is not None:
                    r = p[0].shape[0]
                    b[row:row + r, offsets[i]:offsets[i + 1]] = p[1].T * (p[2] / ref)
                    row += r
        plan[path] = (a, b, int(rank), _alpha(ref, int(rank), use_rslora))
    return plan, used


__all__ = ["Slot", "export_modules", "import_modules", "model_slots", "stacked_size"]
