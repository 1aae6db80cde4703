"""Which node a process is: SkyPilot's environment, the port, and the plan's node count."""

from __future__ import annotations

import pytest

from recipes import UserError
from runtime.entry import main, parse_config
from runtime.procs.cluster import DEFAULT_WORKER_PORT, Cluster, check_plan_fits, cluster_from_env

IPS = "10.0.0.5\n10.0.0.6\n10.0.0.7\n"


def error_of(environ: dict[str, str], port: int | None = None) -> str:
    with pytest.raises(UserError) as info:
        cluster_from_env(environ, port)
    return str(info.value)


def test_no_skypilot_environment_is_one_local_node():
    cluster = cluster_from_env({})
    assert cluster == Cluster()
    assert (cluster.rank, cluster.nodes, cluster.multi_node) == (0, 1, False)
    assert cluster.port == DEFAULT_WORKER_PORT == 26600


def test_skypilot_environment_gives_rank_addresses_and_port():
    cluster = cluster_from_env({"SKYPILOT_NODE_RANK": "2", "SKYPILOT_NODE_IPS": IPS})
    assert (cluster.rank, cluster.ips, cluster.multi_node) == (2, tuple(IPS.split()), True)
    assert (cluster.ip, cluster.head) == ("10.0.0.7", "10.0.0.5")
    assert cluster.name(1) == "node 1 (10.0.0.6)"
    assert cluster.names([1, 2]) == "nodes 1 (10.0.0.6), 2 (10.0.0.7)"
    assert cluster.url(1) == "tcp://10.0.0.6:26600"
    assert cluster.url(0, port=0) == "tcp://10.0.0.5:0"
    env = {"SKYPILOT_NODE_IPS": IPS, "FORGESKY_WORKER_PORT": "4000"}
    assert cluster_from_env(env).port == 4000
    assert cluster_from_env(env, port=5000).port == 5000  # --worker-port wins
    v6 = cluster_from_env({"SKYPILOT_NODE_IPS": "fd00::1\nfd00::2"})
    assert v6.url(1) == "tcp://[fd00::2]:26600"


def test_bad_environment_is_one_line():
    assert error_of({"SKYPILOT_NODE_IPS": IPS, "SKYPILOT_NODE_RANK": "3"}) == (
        "SKYPILOT_NODE_RANK=3 but SKYPILOT_NODE_IPS lists 3 node(s)"
    )
    assert (
        error_of({"SKYPILOT_NODE_RANK": "1"})
        == "SKYPILOT_NODE_RANK=1 but SKYPILOT_NODE_IPS is not set"
    )
    assert error_of({"SKYPILOT_NODE_IPS": "10.0.0.5\nhead"}) == (
        "SKYPILOT_NODE_IPS lists 'head', which is not an IP address"
    )
    assert "twice" in error_of({"SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.5"})
    assert (
        error_of({"FORGESKY_WORKER_PORT": "http"})
        == "FORGESKY_WORKER_PORT='http' is not a port number"
    )
    assert error_of({}, port=70000) == "worker port must be between 1 and 65535, got 70000"


def test_cpu_recipe_spreads_over_the_clusters_nodes(monkeypatch):
    monkeypatch.setenv("SKYPILOT_NODE_IPS", IPS)
    monkeypatch.setenv("SKYPILOT_NODE_RANK", "1")
    config = parse_config(["--recipe", "tiny", "--worker-port", "4100"])
    assert config.plan.num_nodes == 3 and config.cluster.rank == 1 and config.cluster.port == 4100
    assert {p.node for p in config.plan.placements} == {0, 1, 2}
    assert parse_config(["--recipe", "tiny", "--nodes", "2"]).plan.num_nodes == 2


def test_a_plan_that_does_not_fit_the_cluster_exits_2_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("SKYPILOT_NODE_IPS", IPS)
    assert main(["--recipe", "tiny", "--nodes", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "forgesky: error: the plan for tiny on CPU uses 2 nodes but this cluster has 3 "
        "(SKYPILOT_NODE_IPS); run it on 2 nodes (forgesky launch sets num_nodes)"
    )
    monkeypatch.delenv("SKYPILOT_NODE_IPS")
    plan = parse_config(["--recipe", "qwen3-32b", "--gpus", "16"]).plan
    with pytest.raises(UserError, match="uses 2 nodes but this is one machine"):
        check_plan_fits(plan, Cluster())
    assert main(["--recipe", "tiny", "--join-timeout", "0"]) == 2
    assert "--join-timeout must be positive" in capsys.readouterr().err
