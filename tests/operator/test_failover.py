"""Two operator replicas with kopf peering (as the chart runs them): only the leader handles
resources; SIGKILL it in the middle of a burst of creates and the standby takes over, with exactly
one set of children per LlamaFineTune and no spec change lost.

How fast the standby takes over is kopf's, not a timeout of this test: a replica's peering entry
lives `lifetime` seconds after its last keep-alive (kopf/_core/engines/peering.py, Peer.deadline);
the paused standby sleeps until the leader's deadline, then re-reads the peering object, finds the
entry dead, removes it and resumes (process_peering_event). The keep-alive runs every
min(lifetime, max(1, lifetime - randint(5, 10))) seconds (peering.keepalive), i.e. every second
here, so takeover comes at most LIFETIME seconds (plus one round trip) after the kill. The replicas
run with a short lifetime deliberately (`--peering-lifetime`): the chart's default is kopf's 60 s.

The other side of that bound: a leader whose keep-alive is more than LIFETIME - 1 s late (5 s
here, and never more than 5-10 s with kopf's formula, whatever the lifetime) is taken for dead
while it still runs, and the standby resumes beside it until the leader's next keep-alive pauses
it again. So the replicas run with the progress sync slowed down (nothing here needs it): 20
fine-tunes polled every 0.5 s would load a 2-core machine enough to delay the leader's keep-alive."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.operator.conftest import Cluster, Operator, tiny_spec, wait_for

pytestmark = pytest.mark.slow
PEERING = "llamaft-operator"
LIFETIME = 6
"""Seconds; the keep-alive goes every second, so the leader has 5 s of slack (kopf's most: see
above) before the standby would count it dead while it still runs."""
BURST = 20
LABEL = "llamaft.io/finetune"


def log_records(op: Operator, upto: int | None = None) -> list[dict[str, Any]]:
    """The replica's JSON log lines (the first `upto` bytes of the log, when given)."""
    data = op.log_path.read_bytes()[:upto]
    out = []
    for line in data.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def messages(op: Operator, upto: int | None = None) -> list[str]:
    return [str(r.get("message", "")) for r in log_records(op, upto)]


def handled_objects(op: Operator, upto: int | None = None) -> set[str]:
    """Names of the LlamaFineTunes whose handlers ran in this replica (kopf logs every handler run
    with the object it was for)."""
    return {str(r["object"].get("name")) for r in log_records(op, upto)
            if isinstance(r.get("object"), dict) and r["object"].get("kind") == "LlamaFineTune"}


def peering_story(op: Operator) -> list[str]:
    """kopf's pause/resume decisions in this replica, timed (for a failure's message)."""
    return [f"{r.get('timestamp')} {r.get('message')}" for r in log_records(op)
            if str(r.get("message", "")).startswith(("Pausing operations", "Resuming operations", "Possibly conflicting"))]


def peers(cluster: Cluster) -> dict[str, Any]:
    obj: dict[str, Any] = cluster.custom.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", PEERING)  # type: ignore[assignment]
    return dict(obj.get("status") or {})


@pytest.fixture(scope="module")
def peering_object(cluster: Cluster) -> str:
    """What the chart creates beside the Deployment for a cluster-wide operator."""
    cluster.custom.create_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", {
        "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": PEERING}})
    return PEERING


@pytest.fixture()
def replica(kubeconfig: Path, peering_object: str, tmp_path: Path) -> Iterator[Callable[[str], Operator]]:
    """Makes operator replicas as the chart runs them (`llamaft operator --peering NAME`); stops
    those still running at the end."""
    made: list[Operator] = []

    def make(name: str) -> Operator:
        # POD_ID is kopf's peering identity (the chart sets it to the pod's name).
        op = Operator(kubeconfig, tmp_path / f"{name}.log", cli=True, peering=peering_object, verbose=True,
                      args=("--peering-lifetime", str(LIFETIME)), POD_ID=name, LLAMAFT_SYNC_INTERVAL="60")
        made.append(op)
        return op

    yield make
    for op in made:
        op.stop()


def leads(op: Operator) -> bool:
    return "Resuming operations after the pause" in " ".join(messages(op))


def test_standby_takes_over_when_the_leader_is_killed_mid_burst(
        cluster: Cluster, replica: Callable[[str], Operator]) -> None:
    leader, standby = replica("replica-a"), replica("replica-b")

    # The first replica finds nobody above it and resumes; it keeps its entry alive.
    leader.start()
    wait_for("the first replica to lead", lambda: leads(leader) and "replica-a" in peers(cluster), timeout=60)
    # The second one starts paused (--peering makes peering mandatory) and stays so: the leader's
    # entry is live and ranks higher (older replica, see llamaft/operator/peering.py).
    standby.start()
    wait_for("the second replica's keep-alive", lambda: "replica-b" in peers(cluster), timeout=60)
    wait_for("the second replica's paused watch", lambda: any(
        m.startswith("Pausing the watch-stream for llamafinetunes") for m in messages(standby)), timeout=30)
    entries = peers(cluster)
    assert entries["replica-a"]["priority"] > entries["replica-b"]["priority"], entries
    assert entries["replica-a"]["lifetime"] == entries["replica-b"]["lifetime"] == LIFETIME

    # A burst of creates; the leader is killed once it is in the middle of it.
    names = [f"ft-{i:02d}" for i in range(BURST)]
    for name in names[: BURST // 2]:
        cluster.create(name, tiny_spec())
    wait_for("the leader to create a first PyTorchJob", lambda: cluster.jobs(LABEL), timeout=60)
    standby_log_at_kill = standby.log_path.stat().st_size
    leader_log_at_kill = leader.log_path.stat().st_size
    jobs_at_kill = {j["metadata"]["labels"][LABEL] for j in cluster.jobs(LABEL)}
    leader.kill()
    killed = time.monotonic()
    # Spec changes right after the kill, to objects the leader had handled and to ones it had not
    # seen yet, then the rest of the burst: nobody handles them until the standby takes over.
    changed = [names[0], names[BURST // 2 - 1]]
    for name in changed:
        cluster.patch_finetune(name, {"spec": {"runPolicy": {"suspend": True}}})
    for name in names[BURST // 2:]:
        cluster.create(name, tiny_spec())
    cluster.patch_finetune(names[-1], {"spec": {"runPolicy": {"suspend": True}}})
    changed.append(names[-1])

    wait_for("the standby to resume", lambda: leads(standby), timeout=LIFETIME + 30)
    takeover_s = time.monotonic() - killed
    wait_for("the dead leader's entry to be cleaned", lambda: set(peers(cluster)) == {"replica-b"}, timeout=30)

    def pending() -> dict[str, Any]:
        """What is not there yet: per fine-tune, its status without a job of attempt 1 (or with a
        job that does not reflect the spec change)."""
        out: dict[str, Any] = {}
        for name in names:
            status, job = cluster.status(name), cluster.attempt_job(name, 1)
            suspended = (job or {}).get("spec", {}).get("runPolicy", {}).get("suspend")
            if status.get("attempt") != 1 or not status.get("phase") or job is None or (name in changed and suspended is not True):
                out[name] = {"status": {k: status.get(k) for k in ("phase", "attempt", "message")},
                             "job": job is not None, "suspend": suspended}
        return out

    try:
        wait_for("every fine-tune handled by the new leader", lambda: not pending(), timeout=120)
    except AssertionError as exc:
        left = pending()
        window = [n for n, p in left.items() if p["job"] and p["status"]["attempt"] is None]
        hint = (f"\n{window}: the job exists but status.attempt was never recorded: the leader was killed between "
                "creating the job and writing the status (test_a_leader_killed_between_job_and_status_loses_nothing)"
                if window else "")
        raise AssertionError(f"{exc}\npending: {json.dumps(left, indent=1)}{hint}") from None
    done_s = time.monotonic() - killed

    # No duplicate children: one PyTorchJob (attempt 1, no second attempt started by a confused
    # takeover) and the same set of ConfigMaps for every fine-tune (children have deterministic names).
    for name in names:
        jobs = cluster.jobs(f"{LABEL}={name}")
        assert [j["metadata"]["name"] for j in jobs] == [cluster.job_name(name, 1)], (name, jobs)
    assert len(cluster.jobs(LABEL)) == BURST
    configmaps: dict[str, set[str]] = {}
    listed = cluster.api.sanitize_for_serialization(  # type: ignore[no-untyped-call]
        cluster.core.list_namespaced_config_map(cluster.ns, label_selector=LABEL))
    for cm in listed["items"]:
        owner = cm["metadata"]["labels"][LABEL]
        configmaps.setdefault(owner, set()).add(str(cm["metadata"]["name"]).removeprefix(f"{owner}-"))
    assert set(configmaps) == set(names) and "config" in configmaps[names[0]]
    assert all(kinds == configmaps[names[0]] for kinds in configmaps.values()), configmaps
    # No lost update: the spec changes made while nobody led reached the jobs.
    for name in changed:
        assert cluster.attempt_job(name, 1)["spec"]["runPolicy"]["suspend"] is True, name  # type: ignore[index]

    # One active replica at a time: while both lived, the standby handled nothing and never
    # resumed its watch of LlamaFineTunes; the leader did all of that work.
    before_kill = messages(standby, standby_log_at_kill)
    assert not handled_objects(standby, standby_log_at_kill), (
        "the standby handled objects while the leader lived (a late keep-alive of the leader?)",
        peering_story(standby), peering_story(leader))
    assert not [m for m in before_kill if m.startswith(("Resuming operations", "Resuming the watch-stream"))]
    assert handled_objects(leader, leader_log_at_kill) >= jobs_at_kill
    # Afterwards the survivor handled every object, including the leader's.
    assert handled_objects(standby) == set(names)
    assert takeover_s <= LIFETIME + 5, f"takeover took {takeover_s:.1f}s with a {LIFETIME}s peering lifetime"
    print(f"\ntakeover {takeover_s:.1f}s after SIGKILL (peering lifetime {LIFETIME}s); "
          f"all {BURST} fine-tunes handled {done_s:.1f}s after it; leader had created {len(jobs_at_kill)} job(s)")


def test_a_leader_killed_between_job_and_status_loses_nothing(cluster: Cluster, replica: Callable[[str], Operator]) -> None:
    """The narrowest window of a takeover, made deterministic: the old leader created the job and
    died before writing the status of that step. The next leader must record the attempt and apply
    a spec change made meanwhile."""
    crashed = Cluster(cluster.api, namespace="takeover")
    first = replica("replica-c").start()
    crashed.create("window", tiny_spec())
    job = wait_for("the job", lambda: crashed.attempt_job("window", 1), timeout=60)
    wait_for("attempt 1 recorded", lambda: crashed.status("window").get("attempt") == 1, timeout=30)
    first.kill()
    # Back to the moment between create_job and the status write: the job exists, the status
    # holds nothing of this step (it was the first).
    crashed.custom.patch_namespaced_custom_object_status(
        "llamaft.io", "v1alpha1", crashed.ns, "llamafinetunes", "window",
        {"status": {key: None for key in crashed.status("window")}})
    assert crashed.status("window") == {}
    crashed.patch_finetune("window", {"spec": {"runPolicy": {"suspend": True}}})
    second = replica("replica-d").start()  # resumes once replica-c's entry has expired
    wait_for("the next leader", lambda: leads(second), timeout=LIFETIME + 30)
    wait_for("the spec change applied", lambda: (crashed.attempt_job("window", 1) or {}).get("spec", {})
             .get("runPolicy", {}).get("suspend") is True, timeout=30)
    wait_for("attempt 1 recorded again", lambda: crashed.status("window").get("attempt") == 1, timeout=30)
    assert [j["metadata"]["name"] for j in crashed.jobs(LABEL)] == [job["metadata"]["name"]]


def test_older_replicas_rank_higher() -> None:
    import random

    from llamaft.operator.peering import age_priority

    rng = random.Random(7)
    older, newer = age_priority(1_700_000_000_000_000_000, rng), age_priority(1_700_000_000_001_000_000, rng)
    assert older > newer, "a replica started 1 ms later ranks lower whatever the jitter"
    same_ms = {age_priority(1_700_000_000_000_000_000, rng) for _ in range(50)}
    assert len(same_ms) > 40 and all(newer < p <= -1_700_000_000_000_000 for p in same_ms)
    assert abs(age_priority()) < 2**53 and age_priority() < 0 < 100, "below kopf freeze's default 100"


def test_the_cli_passes_kopf_its_peering(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import kopf
    from llamaft import cli

    kubeconfig = tmp_path / "kubeconfig"  # the operator exits 1 naming KUBECONFIG without credentials
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    runs: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "run", lambda **kwargs: runs.append(kwargs))
    monkeypatch.setattr(kopf, "configure", lambda **kwargs: None)
    assert cli.main(["operator", "--peering", "llamaft-operator-x", "--peering-lifetime", "7", "--namespace", "a"]) == 0
    assert cli.main(["operator", "--peering", "p", "--priority", "5", "--all-namespaces"]) == 0
    assert cli.main(["operator", "--standalone"]) == 0
    peered, chosen, alone = runs
    assert (peered["peering_name"], peered["standalone"], peered["clusterwide"], list(peered["namespaces"])) == \
        ("llamaft-operator-x", None, False, ["a"])
    assert peered["settings"].peering.lifetime == 7 and peered["priority"] < 0
    assert (chosen["priority"], chosen["clusterwide"]) == (5, True)
    assert (alone["standalone"], alone["peering_name"], alone["priority"]) == (True, None, None)
    assert alone["settings"].peering.lifetime == 60
