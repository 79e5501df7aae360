"""`kvlm serve --replicas 2 --ray-address HOST:PORT` on a Ray cluster started by `ray start`:
a head and a second node on this machine (tests/ray_cluster.py), one replica on each, a
real `kvlm serve` process joining them, the official openai client. As a user runs it:

    ray start --head --port 6379 --num-cpus 1        # this machine
    ray start --address HEAD:6379 --num-cpus 1       # each other machine
    kvlm serve --replicas 2 --threads 1 --ray-address HEAD:6379   # on the head
"""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest

import serving
from ray_cluster import RayCluster, gone, ray_cluster
from serving import kvlm_serve, openai_client
from test_cluster import (
    REPLICA_PROCESS,
    _answers,
    _endings,
    _stream,
    all_up,
    ask,
    complete,
    wait_for,
)

KEY = "ray-cluster-key"
COMMON = ("--api-key", KEY, "--threads", "1", "--max-context", "1024", "--log-level", "warning")
# what kvlm serve runs on the cluster: Serve's controller, its proxy, the ingress, replicas
SERVE_PROCESSES = ("ray::Serve", "ray::ProxyActor")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(plain_serve_answers):
    """The four greedy answers (chat and completions, streamed and not) of one plain
    `kvlm serve`, with test_cluster's flags (this module's COMMON but for the key, which
    changes no answer): the session's future (conftest.py), made while test_cluster's
    cluster started, or this module's when it runs alone."""
    return plain_serve_answers


@pytest.fixture(scope="module")
def cluster(reference):
    with ray_cluster(cpus=1) as c:  # 1 CPU a node, 1 a replica: one replica on each node
        yield c


@pytest.fixture(scope="module")
def server(cluster):
    with kvlm_serve("--replicas", "2", "--ray-address", cluster.address, *COMMON) as served:
        assert wait_for(lambda: all_up(served[0]), timeout=120), "a replica never came up"
        yield served


@pytest.fixture(scope="module")
def model_name(default_model_path):
    from kvlm.loading import load_model

    return load_model(default_model_path).path.name


def _client(port: int):
    """Every call bounded: a hung stream fails the test instead of stalling the suite."""
    return openai_client(port, KEY).with_options(timeout=60)


def _routed(port: int) -> dict[str, float]:
    m = serving.metrics(port, KEY)
    return {k: v for k, v in m.items() if k.startswith("kvlm_cluster_requests_routed_total")}


def _serve_processes(cluster: RayCluster) -> list[psutil.Process]:
    return [p for node in cluster.nodes for title in SERVE_PROCESSES for p in node.titled(title)]


def test_a_signal_while_it_deploys_still_shuts_serve_down(cluster, model_name):
    """Serve's controller is detached: a `kvlm serve` stopped while its replicas start
    must shut it down, or it outlives the command on the cluster (it used to die of
    Ray's own SIGTERM handler, an abort)."""
    cmd = [sys.executable, "-c", "from kvlm.cli import main; raise SystemExit(main())",
           "serve", "--port", str(serving.free_port()), "--replicas", "2",
           "--ray-address", cluster.address, *COMMON]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: cluster.head.titled("ray::ServeController"), timeout=90)
        proc.send_signal(signal.SIGTERM)  # Serve is starting: no replica answers yet
        assert proc.wait(timeout=60) == 0, proc.stdout.read().decode()[-3000:]
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert not gone(_serve_processes(cluster), timeout=60)


def test_one_replica_on_each_node_answers_as_one_kvlm_serve(cluster, server, reference, model_name):
    port, _ = server
    for node in cluster.nodes:
        assert len(node.titled(REPLICA_PROCESS)) == 1, [p.name() for p in node.processes()]
    assert _answers(_client(port), model_name) == reference.result(timeout=300)[0]


def test_a_repeated_prefix_goes_to_one_replica(server, model_name):
    port, _ = server
    client = _client(port)
    for tenant in ("a bakery", "an observatory"):
        system = f"You are the assistant of {tenant}. " + "Answer briefly and politely. " * 14
        before = _routed(port)
        for question in ("When do you open?", "Where are you?", "What do you sell?"):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            client.chat.completions.create(model=model_name, messages=messages, max_tokens=2)
        after = _routed(port)
        gained = sorted(after[k] - before.get(k, 0) for k in after)
        assert gained[-1] == 3 and sum(gained) == 3, (before, after)  # all on one replica


def test_killing_the_second_nodes_replica_ends_its_stream_cleanly(cluster, server, reference,
                                                                 model_name):  # fmt: skip
    port, _ = server
    client = _client(port)
    # no full block: the router sends each to the least loaded replica, one on each node
    # 80 tokens: in flight at the kill on any machine, short enough to read to its end
    streams = [_stream(client, model_name, "Tell me about cats.", 80),
               _stream(client, model_name, "Tell me about dogs.", 80)]  # fmt: skip
    (victim,) = cluster.second.titled(REPLICA_PROCESS)
    victim.kill()
    assert _endings(streams) == ["done", "failed"]
    # the head's replica answers, as before: the router has dropped the dead one
    chat, _, text, _ = reference.result(timeout=300)[0]
    assert ask(client, model_name).choices[0].message.content == chat
    assert complete(client, model_name).choices[0].text == text


def test_stopping_kvlm_serve_stops_its_actors_and_leaves_the_cluster(cluster, server):
    _, proc = server
    ours = _serve_processes(cluster)
    assert len(ours) >= 4, ours  # controller, proxy, ingress, a replica at least
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stdout.read().decode()[-3000:]
    assert not gone(ours, timeout=60)  # Serve's controller is detached: kvlm serve shut it down
    for node in cluster.nodes:  # the cluster is not kvlm's to stop
        assert node.proc.poll() is None and node.titled("raylet")
