"""``lowrank-jax plan``: per-device memory estimate for a config on N devices."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="per-device memory estimate for a config",
                              description="Estimate parameters, optimizer state and activation "
                                          "memory per device for a config on a mesh.")
    p.add_argument("--config", default="1b")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no-remat", action="store_true",
                   help="assume no rematerialisation (default: the config's model.remat)")
    p.set_defaults(func=run)


def run(args) -> int:
    from lowrank_jax.train import load_config
    from lowrank_jax.train.plan import plan_memory

    if args.devices < 1:
        raise ValueError(f"--devices={args.devices} must be a positive integer.")
    cfg = load_config(args.config, args.overrides)
    plan = plan_memory(cfg, args.devices, remat=False if args.no_remat else None)
    print(f"config {args.config}: {cfg.model.n_layers} layers, d_model {cfg.model.d_model}, "
          f"{cfg.model.projection} (rank ratio {cfg.model.rank_ratio}), batch "
          f"{cfg.train.batch_size} x {cfg.train.seq_len}")
    print(plan.table())
    return 0
