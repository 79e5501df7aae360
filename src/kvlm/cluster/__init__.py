"""`kvlm serve --replicas N`: N kvlm engines behind one OpenAI-compatible endpoint.

Why Ray Serve: it places replicas by the CPUs they ask for, on one machine or many
(`ray start --head`, `ray start --address=...`), health-checks them and starts a new one
when one dies, runs the HTTP proxy, and lets a deployment plug in its own request router,
which is where prefix-aware routing belongs. The shape is Ray Serve LLM's (an OpenAI
ingress in front of LLM servers), with kvlm's engine and kvlm's own app in each replica:

    kvlm.cluster.app      the ingress and replica deployments, the in-process ASGI call
    kvlm.cluster.router   the RequestRouter: the bounded-load hash ring, or round-robin
    kvlm.cluster.ring     consistent hashing with bounded loads
    kvlm.cluster.keys     a request's route key: the prefix-cache key of its first blocks
    kvlm.cluster.metrics  /metrics summed over the replicas

`kvlm serve` without --replicas (or --ray-address) never imports this package's Ray
modules: one process, as before.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import threading
import time

from kvlm.errors import InvalidRequestError, KvlmError

APP_NAME = "kvlm"
# room on a replica beside a full queue (kvlm answers 503 past --max-waiting itself):
# /health and /v1/models still get in
_SPARE_REQUESTS = 8
# how often a stopping replica looks whether its requests have ended (Serve's default, 2 s,
# is the least a shutdown took, also with nothing in flight)
_DRAIN_POLL_S = 0.1
_EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception): ")  # a traceback's last line


def serve_replicas(args: argparse.Namespace) -> int:
    """Run the cluster until SIGINT or SIGTERM; the replicas build their engines from
    `args` (kvlm.server.config), --threads each."""
    ray, serve = _import_ray()
    from kvlm.cluster.router import POLICIES
    from kvlm.loading import load_model
    from kvlm.server.config import serve_config

    if args.replicas < 1 or args.route_blocks < 1 or not args.route_balance >= 1:
        raise InvalidRequestError("--replicas, --route-blocks and --route-balance must be >= 1")
    if args.routing not in POLICIES:
        raise InvalidRequestError(f"--routing: one of {', '.join(POLICIES)}")
    serve_config(args)  # a bad flag is one line now, not a replica failing to start
    name = args.served_model_name or load_model(args.model).path.name  # the model exists
    _check_port(args.host, args.port)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    args = argparse.Namespace(**{**vars(args), "threads": threads})
    _init_ray(ray, args.ray_address, args.replicas * threads)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # this line says it is up
    each = f"{threads} thread{'s' if threads > 1 else ''} each"
    ready = (f"kvlm: serving {name} on http://{args.host}:{args.port}/v1 ({args.replicas} "
             f"replicas, {each}, routing {args.routing}; Ray at "
             f"{ray.get_runtime_context().gcs_address})")  # fmt: skip
    try:
        _serve_until_signal(serve, args, ready)
    finally:
        # Serve's controller is a detached actor: on a cluster of `ray start`, it and the
        # replicas outlive this process unless shut down here, also when the signal came
        # while they were starting. Bounded (Serve waits 30 s for its controller); a
        # second signal meanwhile is ignored rather than leaving them half stopped.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        serve.shutdown()
        ray.shutdown()
    return 0


def _serve_until_signal(serve, args: argparse.Namespace, ready: str) -> None:
    """Deploy (on a thread: serve.run blocks until every replica has loaded its model),
    print `ready`, and return at SIGINT or SIGTERM, whether or not the deployment has
    finished. The handlers replace ray.init's (Python's for SIGTERM, then the core
    worker's, which aborts the process before Serve is shut down) and only note the
    signal: an exception raised from a handler inside Ray's code comes out as another."""
    signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: signals.append(signum))
    failure: list[BaseException] = []

    def deploy() -> None:
        try:
            _deploy(serve, args)
        except BaseException as exc:  # handed to the main thread
            failure.append(exc)

    thread = threading.Thread(target=deploy, name="kvlm-deploy", daemon=True)
    thread.start()
    while not signals and thread.is_alive():
        time.sleep(0.25)
    if signals:
        return
    if failure:
        raise failure[0]
    print(ready, file=sys.stderr, flush=True)
    while not signals:
        time.sleep(0.25)


def application(args: argparse.Namespace):
    """The Serve application: the ingress bound to N replicas behind KvlmRouter."""
    from ray.serve.config import RequestRouterConfig

    from kvlm.cluster.app import Ingress, KvlmReplica
    from kvlm.cluster.router import KvlmRouter

    kwargs = {"policy": args.routing, "balance": args.route_balance}
    router = RequestRouterConfig(request_router_class=KvlmRouter, request_router_kwargs=kwargs)
    replicas = KvlmReplica.options(
        num_replicas=args.replicas,
        ray_actor_options={"num_cpus": args.threads},
        max_ongoing_requests=args.max_num_seqs + args.max_waiting + _SPARE_REQUESTS,
        request_router_config=router,
        graceful_shutdown_wait_loop_s=_DRAIN_POLL_S,
    )
    ingress = Ingress.options(
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=args.max_connections,
        graceful_shutdown_wait_loop_s=_DRAIN_POLL_S,
    )
    return ingress.bind(args, replicas.bind(args))


def _deploy(serve, args: argparse.Namespace) -> None:
    """Serve's proxy on --host:--port, then the application, waiting until every replica
    has loaded its model. A failure (a replica that cannot start) is one line."""
    level = args.log_level.upper()
    logs = {"log_level": level, "enable_access_log": level == "INFO"}
    try:
        serve.start(http_options={"host": args.host, "port": args.port},
                    logging_config={"log_level": "WARNING"})  # fmt: skip
        serve.run(application(args), name=APP_NAME, route_prefix="/", logging_config=logs)
    except Exception as exc:  # RuntimeError: "Failed to update the deployments ..."
        reason = _replica_error(serve) or str(exc).strip().splitlines()[0]
        raise KvlmError(f"the replicas did not start: {reason}") from exc


def _replica_error(serve) -> str | None:
    """The exception a replica's constructor raised (`kvlm.errors.ModelLoadError: ...`),
    read off the tracebacks Serve keeps in the deployments' status."""
    try:
        deployments = serve.status().applications[APP_NAME].deployments.values()
    except Exception:  # no status to read: the caller has its own message
        return None
    lines = [line.strip() for d in deployments for line in d.message.splitlines()]
    errors = [line for line in lines if _EXCEPTION_LINE.match(line)]
    return errors[-1] if errors else None


def _check_port(host: str, port: int) -> None:
    """Fail before starting Ray if the port is taken (Serve's proxy would, in a traceback)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as exc:
            raise KvlmError(f"could not serve on {host}:{port} (is the port in use?)") from exc


def _import_ray():
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise KvlmError(
            f"--replicas runs on Ray Serve, which is not installed ({exc}): "
            'pip install -e ".[cluster]"'
        ) from exc
    return ray, serve


# Ray Serve's proxy checks (ray/serve/_private/constants.py) and the seconds kvlm gives them
PROXY_CHECKS = ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S")
PROXY_CHECK_S = 60
WORKER_NICENESS = "RAY_worker_niceness"  # Ray's setting for its workers' niceness (15)


def _init_ray(ray, address: str | None, cpus_wanted: int) -> None:
    """Join the cluster at `address` ("auto": the one started on this machine), or start
    Ray here with CPUs enough for the replicas (oversubscribed rather than never placed)."""
    quiet = {"include_dashboard": False, "logging_level": logging.WARNING}
    try:
        if address:
            ray.init(address=address, **quiet)
        else:
            cpus = max(os.cpu_count() or 1, cpus_wanted)
            # Serve's proxy must answer its readiness check in 5 s and health checks in
            # 10 (else it is killed, and here the start fails: "the replicas did not
            # start: The actor died unexpectedly"): on a busy 2-core box, with replicas
            # loading their models beside it, it missed them. The actors of a cluster
            # started here inherit this process's environment; a user's setting wins.
            for name in PROXY_CHECKS:
                os.environ.setdefault(name, str(PROXY_CHECK_S))
            # Ray lowers its workers to niceness 15 (RAY_worker_niceness), below the driver:
            # here the workers are the server (Serve's proxy, the replicas), and at 15
            # anything else on the box starves them (the proxy never got through its
            # imports beside three test workers at 0 on two cores). They run at this
            # process's priority, as a one-process `kvlm serve` does; `nice kvlm serve`
            # lowers both.
            os.environ.setdefault(WORKER_NICENESS, "0")
            ray.init(address="local", num_cpus=cpus, object_store_memory=256 << 20, **quiet)
    except (ConnectionError, RuntimeError) as exc:
        raise KvlmError(f"could not start or join Ray ({address or 'local'}): {exc}") from exc
