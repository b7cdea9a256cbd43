"""Load SmolLM2-135M-Instruct, time loading and a 1024-token evaluation, measure perplexity.

What it measures (all in one run, so ratios are meaningful on a shared machine):
  * load time (GGUF parse + Q4_1/Q8_0 dequantization + model build, and the tokenizer),
  * the time to evaluate 1024 tokens (first call = compile + run, then steady state), relative to
    a reference op measured in the same run: one dense fp32 matmul with the same FLOP count,
  * perplexity on the bundled English text (license texts + the Python license), windows of
    1024 tokens, and the same with llama.cpp's Q/K row order left in place (the wrong RoPE
    pairing) to show the un-permutation matters,
  * a greedy chat generation sample and its decode speed.

Usage::

    python -m scripts.bench.loading            # full: all windows of the English text
    python -m scripts.bench.loading --quick    # 2 windows, shorter generation
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
from tqdm.auto import tqdm

from lowrank_jax.bench import reference_matmul_seconds, time_fn, time_once
from lowrank_jax.models.flops import forward_flops
from lowrank_jax.models.gguf import gguf_rope_order


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", default="runs/bench_loading")
    parser.add_argument("--quick", action="store_true", help="2 windows, 24 generated tokens")
    parser.add_argument("--window", type=int, default=1024)
    args = parser.parse_args(argv)

    from lowrank_jax.models.generate import english_eval_text, generate, perplexity
    from lowrank_jax.models.gguf import gguf_metadata, load_gguf, open_gguf
    from lowrank_jax.hub import resolve_model
    from lowrank_jax.models.tokenizer import BPETokenizer

    os.makedirs(args.out, exist_ok=True)
    results: dict = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
                     "cpu_count": os.cpu_count(), "jax": jax.__version__,
                     "backend": jax.default_backend(), "window": args.window,
                     "quick": args.quick}
    rows = []

    # ---------------------------------------------------------------- load
    path = resolve_model(args.model)
    read_s, raw_mb = time_once(lambda: len(Path(path).read_bytes()) / 2**20)
    results["file_mb"] = raw_mb
    load_s, (model, meta) = time_once(load_gguf, path)  # blocks on every array it returns
    tokenizer_s, tokenizer = time_once(BPETokenizer.from_gguf_metadata, meta)
    parse_s, _ = time_once(lambda: gguf_metadata(open_gguf(path)))
    cfg = model.cfg
    results.update(read_file_s=read_s, load_model_s=load_s, gguf_parse_s=parse_s,
                   tokenizer_s=tokenizer_s)
    rows += [("read the GGUF bytes (baseline)", read_s, 1.0),
             ("GGUF header + metadata parse", parse_s, parse_s / read_s),
             ("load model (parse + dequantize + build)", load_s, load_s / read_s),
             ("build tokenizer from metadata", tokenizer_s, tokenizer_s / read_s)]

    # ---------------------------------------------------------------- 1024-token evaluation
    text = english_eval_text()
    ids = tokenizer.encode(text)
    results["eval_text"] = ("lowrank_jax/models/data/licenses.txt (MIT, BSD-3, Apache-2.0) + "
                            "Python's LICENSE.txt + the Zen of Python (english_eval_text())")
    results["eval_text_tokens"] = len(ids)
    window = min(args.window, len(ids))
    first = ids[:window]
    flops = forward_flops(cfg, window)
    ref_s, ref_n = reference_matmul_seconds(flops)
    first_s, _ = time_once(lambda: perplexity(model, first, window=window, progress=False))
    res_first = perplexity(model, first, window=window, progress=False)
    steady_s = time_fn(lambda: perplexity(model, first, window=window, progress=False).nll,
                       reps=2, warmup=0)
    results.update(eval_tokens=window, eval_flops=flops, reference_matmul_n=ref_n,
                   reference_matmul_s=ref_s, eval_first_call_s=first_s, eval_steady_s=steady_s,
                   eval_tokens_per_s=window / steady_s, ppl_first_window=res_first.perplexity)
    rows += [(f"reference: {ref_n}x{ref_n} fp32 matmul (same FLOPs)", ref_s, 1.0),
             (f"eval {window} tokens, first call (compile + run)", first_s, first_s / ref_s),
             (f"eval {window} tokens, steady state", steady_s, steady_s / ref_s)]

    # ---------------------------------------------------------------- perplexity
    n_tokens = min(len(ids), 2 * window) if args.quick else len(ids)
    full = perplexity(model, ids[:n_tokens], window=window, progress=True)
    results.update(ppl=full.perplexity, ppl_nll=full.nll, ppl_scored_tokens=full.n_tokens,
                   ppl_windows=full.n_windows)
    wrong_tokens = ids[:256]
    correct_short = perplexity(model, wrong_tokens, window=256, progress=False).perplexity
    with gguf_rope_order(model):
        wrong_short = perplexity(model, wrong_tokens, window=256, progress=False).perplexity
    restored = perplexity(model, wrong_tokens, window=256, progress=False).perplexity
    results.update(ppl_256_correct=correct_short, ppl_256_gguf_row_order=wrong_short,
                   ppl_256_restored=restored)

    # ---------------------------------------------------------------- generation
    question = "What are three tips for writing clear documentation?"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    max_new = 24 if args.quick else 96
    bar = tqdm(total=max_new, desc="generate", unit="tok", leave=False)
    gen_s, out = time_once(lambda: generate(model, tokenizer, prompt, max_new_tokens=max_new,
                                            stream=lambda token, piece: bar.update(1)))
    bar.close()
    gen_steady_s, out2 = time_once(
        lambda: generate(model, tokenizer, prompt, max_new_tokens=max_new))
    assert out2.token_ids == out.token_ids
    results.update(chat_question=question, chat_answer=out.text, chat_new_tokens=len(out.token_ids),
                   generate_first_call_s=gen_s, generate_steady_s=gen_steady_s,
                   decode_tokens_per_s=len(out.token_ids) / gen_steady_s)

    # ---------------------------------------------------------------- report
    print(f"\nSmolLM2-135M-Instruct ({os.path.basename(path)}, {results['file_mb']:.1f} MiB), "
          f"{jax.default_backend()}, {os.cpu_count()} cores (shared machine: absolute times vary)")
    print(f"{'step':<52} {'seconds':>9} {'x baseline':>11}")
    for name, seconds, ratio in rows:
        print(f"{name:<52} {seconds:>9.3f} {ratio:>11.2f}")
    print(f"\nperplexity on {full.n_tokens} tokens ({full.n_windows} windows of {window}): "
          f"{full.perplexity:.3f}")
    print(f"first 256 tokens: correct RoPE rows {correct_short:.3f}, llama.cpp row order "
          f"{wrong_short:.1f}, restored {restored:.3f}")
    print(f"greedy chat ({len(out.token_ids)} tokens, {results['decode_tokens_per_s']:.1f} tok/s "
          f"steady):\n  Q: {question}\n  A: {out.text}")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({**results, "table": [list(r) for r in rows]}, f, indent=2)
    print(f"\nwrote {os.path.join(args.out, 'results.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
