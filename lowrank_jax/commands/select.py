"""``lowrank-jax select``: pick a weighted subset of rows (a coreset) for fine-tuning.

From an embedding matrix (``--embeddings FILE.npy``, optional per-row ``--losses``) or from a
text file (``--text FILE``: cut into token chunks, embedded with the model's mean-pooled final
hidden states; the chunks' own NLL is the loss). Writes the distinct selected indices to
``--out`` and their weights (for the average loss) next to it (``*_weights.npy``).
"""

from __future__ import annotations

import argparse
import os

from lowrank_jax.runs.validate import non_negative_int, positive_int


def register(subparsers) -> None:
    """Add the ``select`` subcommand."""
    p = subparsers.add_parser(
        "select", help="low-rank residual data selection: a weighted subset for fine-tuning",
        description="Fit a rank-k subspace to the embeddings and sample rows by their residual "
                    "(sensitivity sampling with uniform mixing); weights are inverse "
                    "probabilities, so the weighted subset loss estimates the full average.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--embeddings", help="[n, d] float .npy (memory-mapped, streamed in chunks)")
    src.add_argument("--text", help="UTF-8 text file: chunked and embedded with --model")
    p.add_argument("--budget", type=int, required=True, help="number of draws m")
    p.add_argument("--out", required=True, help="output .npy of selected row/chunk indices")
    p.add_argument("--losses", default=None, help="[n] .npy of per-row losses (optional)")
    p.add_argument("--method", default="lowrank", choices=("lowrank", "kmeans", "uniform"))
    p.add_argument("--rank", type=positive_int, default=None,
                   help="subspace rank k, below the embedding dimension d (default 32, or "
                        "d - 1 for smaller embeddings)")
    p.add_argument("--angular", action="store_true", help="normalise rows (angular residuals)")
    p.add_argument("--chunk-rows", type=positive_int, default=65536,
                   help="rows per streamed block")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--model", default="smollm2", help="with --text: model name or path")
    p.add_argument("--max-tokens", type=positive_int, default=256,
                   help="with --text: tokens per chunk")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="with --text: chunks per forward")
    p.set_defaults(func=run)


def _load_npy(path: str, flag: str):
    import numpy as np

    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file.")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"{flag} {path}: not a NumPy .npy array ({reason[:80]}); save it "
                         "with numpy.save.") from None
    if not np.issubdtype(array.dtype, np.number):
        raise ValueError(f"{flag} {path}: holds {array.dtype} values; give a float array.")
    return array


def _check_finite(array, flag: str, path: str, block: int = 65536) -> None:
    """Refuse NaN / inf entries (streamed in blocks of rows: the file may be larger than
    memory)."""
    import numpy as np

    for start in range(0, max(int(array.shape[0]), 1), block):
        part = np.asarray(array[start:start + block])
        if part.size and not np.isfinite(part).all():
            row = start + int(np.argwhere(~np.isfinite(part))[0][0])
            raise ValueError(f"{flag} {path}: row {row} holds NaN or inf values; remove or "
                             "fix those rows.")


def _rank(args, A) -> int:
    """``--rank``, checked against the embeddings ``A [n, d]``: a rank of ``min(n, d)`` or
    more leaves no residual (every row lies in the subspace), so the sampling has nothing to
    measure; unset, it is 32 capped at ``min(n, d) - 1``."""
    default = 32
    if getattr(A, "ndim", 0) != 2 or args.method == "uniform":
        return default if args.rank is None else args.rank
    limit = min(int(A.shape[0]), int(A.shape[1])) - 1
    source = f"--embeddings {args.embeddings}" if args.embeddings else f"--text {args.text}"
    if limit < 1:
        raise ValueError(f"{source}: {A.shape[0]} rows of dimension {A.shape[1]} leave no room "
                         "for a subspace fit; give more rows and dimensions, or --method "
                         "uniform.")
    if args.rank is None:
        return min(default, limit)
    if args.rank > limit:
        raise ValueError(f"--rank {args.rank} must be below min(rows, dimension) = "
                         f"{limit + 1} of {source} (at that rank every row lies in the "
                         f"subspace and the residuals are 0); pass --rank {limit} or less.")
    return args.rank


def _weights_path(out: str) -> str:
    return os.path.splitext(out)[0] + "_weights.npy"


def run(args: argparse.Namespace) -> int:
    """Load or embed, select, save, print a summary line; returns the exit code."""
    import jax
    import numpy as np

    from lowrank_jax.data.selection import chunk_tokens, compact, select_subset, text_embeddings

    from lowrank_jax.runs.outputs import check_not_input

    if args.budget < 1:
        raise ValueError(f"--budget {args.budget} must be a positive number of draws.")
    reads = {"--embeddings": args.embeddings, "--losses": args.losses, "--text": args.text,
             "--model": args.model if args.text is not None else None}
    check_not_input(args.out, reads)
    check_not_input(_weights_path(args.out), reads, argument="the weights file")
    losses = None if args.losses is None else np.asarray(_load_npy(args.losses, "--losses"))
    if losses is not None and losses.ndim >= 1:
        _check_finite(losses, "--losses", args.losses)
    if args.text is not None:
        from lowrank_jax.hub import load_model

        if not os.path.isfile(args.text):
            raise FileNotFoundError(f"--text {args.text}: no such file.")
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
        model, tokenizer = load_model(args.model)
        if tokenizer is None:
            raise ValueError(f"--model {args.model}: the checkpoint has no tokenizer.")
        chunks = chunk_tokens(tokenizer.encode(text), args.max_tokens)
        if not chunks:
            raise ValueError(f"--text {args.text}: too short for one chunk of tokens.")
        A, nll = text_embeddings(model, chunks, batch_size=args.batch_size, with_loss=True)
        losses = nll if losses is None else losses
        print(f"embedded {len(chunks)} chunks of <= {args.max_tokens} tokens with {args.model}")
        chunk_rows = None
    else:
        A = _load_npy(args.embeddings, "--embeddings")
        if A.ndim >= 1:
            _check_finite(A, "--embeddings", args.embeddings, args.chunk_rows)
        chunk_rows = args.chunk_rows if A.shape[0] > args.chunk_rows else None
        if chunk_rows is None:
            A = np.asarray(A, np.float32)
    rank = _rank(args, A)
    coreset = select_subset(jax.random.key(args.seed), A, args.budget, losses=losses,
                            method=args.method, rank=rank, angular=args.angular,
                            chunk_rows=chunk_rows)
    idx, weights = compact(coreset.idx, coreset.weights)
    np.save(args.out, idx)
    weights_path = _weights_path(args.out)
    np.save(weights_path, weights.astype(np.float32))
    print(f"selected {len(idx)} distinct of {A.shape[0]} rows ({args.budget} draws, "
          f"method={args.method}, rank={rank}, lipschitz={float(coreset.lipschitz):.4g}, "
          f"queried {len(coreset.rep_idx)} representatives) -> {args.out}, {weights_path}")
    return 0
