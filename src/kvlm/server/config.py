"""`kvlm serve`'s configuration from its parsed arguments: the engine's configuration, the
server's limits, the model and its sampling defaults. `kvlm serve` builds them once; each
replica of `kvlm serve --replicas` builds them from the same arguments (and the cluster
checks them first, so a bad flag is one line before anything starts)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from kvlm.settings import model_from_args, speculative_from_args

log = logging.getLogger("kvlm")


def serve_config(args: argparse.Namespace):
    """`kvlm serve`'s engine configuration and server limits from its arguments."""
    from kvlm.cache.memory import parse_size
    from kvlm.cache.tier_key import load_tier_key
    from kvlm.cache.tiers import check_tier
    from kvlm.engine.engine import EngineConfig
    from kvlm.engine.scheduler import SchedulerConfig
    from kvlm.errors import InvalidRequestError
    from kvlm.server.defaults import from_flags
    from kvlm.server.limits import ServerLimits

    from_flags(args)  # --temperature and the like: a bad value before the slow load
    try:
        sched = SchedulerConfig(args.max_num_seqs, args.prefill_chunk, args.max_waiting,
                                step_time=args.step_time or None)  # fmt: skip
        limits = ServerLimits(
            max_body_bytes=parse_size(args.max_body),
            idle_timeout_s=args.idle_timeout,
            max_connections=args.max_connections,
            public_metrics=args.public_metrics,
            engine_wait_s=args.engine_wait,
            stream_ping_s=args.stream_ping,
        )
        spec = speculative_from_args(args)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc
    kv_memory = parse_size(args.kv_memory) if args.kv_memory else None
    if args.slot_save_path:  # its K/V: a disk tier of its own, asked first
        path = Path(args.slot_save_path).expanduser()
        try:
            (path / "kv").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidRequestError(f"--slot-save-path {path}: {exc.strerror}") from None
        args.slot_save_path = str(path)
        args.kv_tier = [f"disk:{path / 'kv'}", *args.kv_tier]
    for tier in args.kv_tier:
        check_tier(tier)  # a typo is refused before the slow load
    key = args.kv_tier_key
    if key is not None and not args.kv_tier:
        raise InvalidRequestError("--kv-tier-key signs KV tier records: it needs --kv-tier")
    if args.kv_tier:
        load_tier_key(key)  # a missing or loose key too
    share = {} if args.snapshot_share is None else {"snapshot_share": args.snapshot_share}
    config = EngineConfig(args.kv_blocks, kv_memory, args.prefix_caching, sched,
                          speculative=spec, kv_tiers=tuple(args.kv_tier),
                          kv_tier_key=key, **share)  # fmt: skip
    return config, limits


def serve_model(args: argparse.Namespace, config):
    """The LLM `kvlm serve` runs, from its arguments and its engine's configuration
    (serve_config). Without --max-context its context is the model's trained one as far as
    the KV pool holds one sequence of it (kvlm.engine.engine.pool_context; said in a
    warning where it falls short), not the library's 4,096: an agent's prompt of 20k
    tokens fits a model trained on 32k."""
    from kvlm.engine.engine import pool_context
    from kvlm.llm import CacheOptions

    options = CacheOptions(args.block_size, args.kv_blocks)
    llm = model_from_args(args, kv="paged", cache_options=options)
    if args.max_context is None:
        trained = llm.config.max_position_embeddings
        # within the trained context: the RoPE the LLM was built with serves it as is
        llm.max_context = pool_context(llm, config, trained)
        if llm.max_context < trained:
            n = llm.max_context
            log.warning("the KV pool holds one sequence of %d tokens, short of the model's "
                        "trained context of %d: the context limit is %d (--kv-memory or "
                        "--kv-blocks raise it)", n, trained, n)  # fmt: skip
    return llm


def serve_sampling(args: argparse.Namespace, llm):
    """The sampling defaults `llm` is served with (kvlm.server.defaults): the flags' over
    its file's recommendation, said in one line."""
    from kvlm.server.defaults import from_flags, resolve

    defaults = resolve(from_flags(args), llm.loaded.sampling, llm.model_name)
    log.info("%s", defaults.describe())
    return defaults
