"""Finding 1, "Open c10d stores": a stranger on the cluster's network reads and changes nothing.

Before: the manager's control store and each generation's store were
``TCPStore`` servers on every interface, answering anyone; from another network
namespace a client read the keys and set ``rank/1/owner`` to 999, and the job
FAILED at its next crash. Now every store is served by the manager behind a
handshake that proves the job's key (``undying.manager.stores``).

The test runs a two-node job (manager, two agents: three hosts) and a fourth
host holding neither token nor key. That host lists every port the job's hosts
listen on, and against each one tries raw bytes, the HTTP API without a token,
c10d's ``TCPStore`` client (reading and writing ``gen/current``,
``rank/1/owner``, gloo's keys and random ones) and undying's store protocol
under a wrong key. Nothing is read, nothing is written, the API answers 401;
then a rank crashes and the job recovers with losses identical, bit for bit, to
the fault-free run's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.netns import Hosts, make_hosts  # noqa: F401 - the fixture
from tests.oracle import Oracle
from undying.demo.cluster import Cluster
from undying.demo.oracle import compare_runs, load_run
from undying.jobfiles.events import read_job
from undying.jobfiles.jobdir import JobDir

# test_multinode.py's job, twice as long (192 steps of ~0.1 s): it is still training when the stranger is done.
SCRIPT_ARGS = ["--epochs", "6", "--samples", "2048", "--step-seconds", "0.1"]
RUN_ARGS = ["--heartbeat-timeout", "3", "--spares", "0", "--rendezvous-timeout", "60"]
STRANGER = Path(__file__).with_name("stranger.py")
WILDCARD = ("*", "0.0.0.0", "[::]")


def _listening(hosts: Hosts, i: int) -> list[tuple[str, int]]:
    out = hosts.popen(i, ["ss", "-Hltn"], stdout=subprocess.PIPE, text=True).communicate(timeout=10)[0]
    found = []
    for line in out.splitlines():
        address, port = line.split()[3].rsplit(":", 1)
        found.append((address, int(port)))
    return found


def test_a_stranger_on_another_host_reads_and_changes_nothing_and_a_crash_is_still_recovered(
        make_hosts: Callable[[int], Hosts], tmp_path: Path, oracle: Oracle) -> None:  # noqa: F811
    hosts = make_hosts(4)
    stranger_host = 3
    cluster = Cluster(hosts, tmp_path, "strangers", SCRIPT_ARGS, run_args=RUN_ARGS)
    try:
        cluster.start()
        cluster.wait_for_step(5)
        listening = {i: _listening(hosts, i) for i in range(3)}
        wildcard = {i: [a for a in found if a[0] in WILDCARD] for i, found in listening.items()}
        assert not any(wildcard.values()), f"listening on every interface: {wildcard}"
        # What the stranger can reach: every port on the hosts' own addresses (loopback is each host's own).
        targets = sorted({(address, port) for found in listening.values() for address, port in found
                          if not address.startswith(("127.", "[::1]", "[::ffff:127."))})
        http_port = int(str(JobDir(cluster.job_dir).read_manager()["url"]).rsplit(":", 1)[1].strip("/"))
        manager_ports = {port for address, port in targets if address == hosts.addr(0)}
        assert {cluster.port, cluster.port + 1, http_port} <= manager_ports, (targets, listening)

        attack = hosts.popen(stranger_host, [sys.executable, str(STRANGER), json.dumps(targets)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started = time.monotonic()
        out, err = attack.communicate(timeout=120)
        print(f"the stranger tried {len(targets)} ports in {time.monotonic() - started:.1f} s: {targets}")
        assert attack.returncode == 0, err[-3000:]
        results = [json.loads(line) for line in out.splitlines()]
        assert len(results) == len(targets), out

        for result in results:
            where = result["target"]
            assert result["raw"]["connected"], result  # it reached the port: the test is no test otherwise
            assert result["tcpstore"]["read"] == [] and result["tcpstore"]["wrote"] == [], result
            assert result["wrong_key"]["read"] == [] and result["wrong_key"]["wrote"] == [], result
            answered = [code for code in result["http"].values() if isinstance(code, int)]
            assert all(code in (401, 403) for code in answered), (where, result["http"])
        api = next(r for r in results if r["target"] == f"{hosts.addr(0)}:{http_port}")
        assert set(api["http"].values()) == {401}, api
        store = next(r for r in results if r["target"] == f"{hosts.addr(0)}:{cluster.port + 1}")
        assert any("key was not shown" in e for e in store["wrong_key"]["errors"]), store

        step = cluster.status()["step"]
        assert step < 180, f"the job is at step {step} of 192: too far on for the crash to test anything"
        cluster.inject({"kind": "crash", "rank": 1, "at_step": step + 3})
        assert cluster.wait(120) == 0, cluster.logs()
    finally:
        cluster.close()

    baseline = oracle.baseline(SCRIPT_ARGS, ranks=4)
    run = load_run(cluster.job_dir / "events.db")
    comparison = compare_runs(baseline, run)
    assert comparison.identical, (comparison.reasons, cluster.logs())
    assert comparison.lost_steps == 0 and not run.rerun_steps
    job = read_job(cluster.job_dir / "events.db")
    incidents = [(i["kind"], i["rank"], i["status"]) for i in job["incidents"]]
    assert incidents == [("crash", 1, "recovered")], (incidents, cluster.logs())
