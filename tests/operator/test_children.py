"""Children are reconciled, not created once (issue 13): server-side apply of the config, the
managed etcd and the monitoring objects; edits the run does not need restarted for apply in place;
children the spec no longer wants are pruned; hand edits and deletions are repaired; deletion is
left to the garbage collector. The real kopf runtime against the emulator (whose server-side apply
is tests/operator/apply.py, unit-tested first)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from llamaft.operator.kube import USER_AGENT
from llamaft_trainer.process.local_etcd import LocalEtcd

from tests.operator import apply as ssa
from tests.operator.conftest import Cluster, Operator, own_emulator, tiny_spec, wait_for
from tests.operator.emulator import EmulatorThread

ETCD = {"backend": "etcd-v2"}  # managed etcd


@pytest.fixture(scope="module")
def emulator() -> Iterator[EmulatorThread]:
    """This module's emulator records every request (who deleted what)."""
    emu = EmulatorThread(record=True).start()
    yield emu
    emu.stop()


# ------------------------------------------------------------------ the emulator's apply rules
def test_apply_creates_merges_and_removes_what_the_manager_no_longer_sets() -> None:
    first = ssa.apply(None, {"metadata": {"name": "x", "labels": {"a": "1", "b": "2"}}, "data": {"k": "v"}}, "llamaft", True)
    assert first["metadata"]["labels"] == {"a": "1", "b": "2"}
    first["metadata"]["labels"]["someone-else"] = "kept"  # a field nobody applied
    second = ssa.apply(first, {"metadata": {"name": "x", "labels": {"a": "1"}}, "data": {"k": "w"}}, "llamaft", True)
    assert second["metadata"]["labels"] == {"a": "1", "someone-else": "kept"}, "b was llamaft's and is no longer applied"
    assert second["data"] == {"k": "w"}
    assert ssa.apply(second, {"metadata": {"name": "x", "labels": {"a": "1"}}, "data": {"k": "w"}}, "llamaft", True) is second, \
        "an apply that changes nothing is not a write"


def test_an_apply_right_after_the_create_that_changes_nothing_is_not_a_write() -> None:
    """The create's managedFields entry records the apiVersion the manager applied with, as the
    API server does: with an empty one, the second identical apply of every child rewrote it, and
    an operator restarted after the first apply reported every child as applied (the flake in
    test_a_restart_or_a_status_change_applies_nothing_and_says_so)."""
    config = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}, "spec": {"replicas": 1}}
    created = ssa.apply(None, config, "llamaft", True)
    assert [e["apiVersion"] for e in created["metadata"]["managedFields"]] == ["apps/v1"]
    assert ssa.apply(created, config, "llamaft", True) is created


def test_apply_conflicts_with_another_manager_unless_forced() -> None:
    theirs = ssa.apply(None, {"metadata": {"name": "x"}, "spec": {"port": 1}}, "kubectl", False)
    with pytest.raises(ssa.ApplyConflict, match='conflict with "kubectl": .spec.port'):
        ssa.apply(theirs, {"metadata": {"name": "x"}, "spec": {"port": 2}}, "llamaft", False)
    ours = ssa.apply(theirs, {"metadata": {"name": "x"}, "spec": {"port": 2}}, "llamaft", True)
    assert ours["spec"]["port"] == 2
    assert ssa.owners(ours) == {"llamaft": {("spec", "port")}}, "force takes the field over"


def test_the_client_applies_through_the_emulator(cluster: Cluster) -> None:
    """kube.Kube.apply against the emulator: created (201), updated, unchanged (same resourceVersion)."""
    from llamaft.operator.kube import Kube

    kube = Kube(cluster.api)
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "applied", "namespace": "default",
                                                                "labels": {"llamaft.io/finetune": "none"}}, "data": {"a": "1"}}
    created = kube.apply("default", cm)
    assert created["data"] == {"a": "1"} and created["metadata"]["managedFields"][0]["manager"] == "llamaft"
    assert kube.apply("default", cm)["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    updated = kube.apply("default", {**cm, "data": {"b": "2"}})
    assert updated["data"] == {"b": "2"}, "a key llamaft no longer sets is removed"
    again = kube.apply("default", {**cm, "data": {"b": "2"}})
    assert again["metadata"]["resourceVersion"] == updated["metadata"]["resourceVersion"]
    assert [c["metadata"]["name"] for c in kube.list_children("default", "ConfigMap", "llamaft.io/finetune=none")] == ["applied"]
    cluster.core.delete_namespaced_config_map("applied", "default")


# ------------------------------------------------------------------------- the operator
@pytest.fixture(scope="module")
def operator(etcd_operator: Operator) -> Operator:
    return etcd_operator


def custom(cluster: Cluster, plural: str, name: str) -> dict[str, Any] | None:
    try:
        obj: dict[str, Any] = cluster.custom.get_namespaced_custom_object("monitoring.coreos.com", "v1", cluster.ns, plural, name)
        return obj
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def started(cluster: Cluster, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    cluster.create(name, spec)
    if spec.get("rendezvous", {}).get("backend") != "c10d":
        wait_for("etcd", lambda: cluster.exists("Deployment", f"{name}-etcd"))
        cluster.make_etcd_ready(f"{name}-etcd")
    return wait_for("attempt 1", lambda: cluster.attempt_job(name, 1))


def reasons(cluster: Cluster, name: str) -> list[str]:
    return [e["reason"] for e in cluster.events(name)]


def test_a_new_scrape_selector_relabels_the_monitoring_in_place(cluster: Cluster, operator: Operator) -> None:
    spec = tiny_spec(monitoring={"dcgm": {"scrapeSelector": {"release": "old"}}})
    job = started(cluster, "relabel", spec)
    monitor = wait_for("PodMonitor", lambda: custom(cluster, "podmonitors", "relabel-trainer"))
    assert monitor["metadata"]["labels"]["release"] == "old"
    cluster.patch_finetune("relabel", {"spec": {"monitoring": {"dcgm": {"scrapeSelector": {"release": None, "team": "nlp"}}}}})
    monitor = wait_for("relabelled", lambda: (m := custom(cluster, "podmonitors", "relabel-trainer")) and
                       m["metadata"]["labels"].get("team") == "nlp" and m)
    assert "release" not in monitor["metadata"]["labels"], "the label llamaft no longer renders is removed"
    rule = wait_for("rule", lambda: (r := custom(cluster, "prometheusrules", "relabel-alerts")) and
                    r["metadata"]["labels"].get("team") == "nlp" and r)
    assert "release" not in rule["metadata"]["labels"]
    status = cluster.status("relabel")
    assert status["attempt"] == 1 and cluster.attempt_job("relabel", 1)["metadata"]["uid"] == job["metadata"]["uid"], \
        "monitoring edits do not restart training"
    assert "MonitoringChanged" in wait_for("event", lambda: reasons(cluster, "relabel"))


def test_turning_dcgm_off_prunes_its_objects(cluster: Cluster, operator: Operator) -> None:
    started(cluster, "prune", tiny_spec())
    wait_for("alerts", lambda: custom(cluster, "prometheusrules", "prune-alerts"))
    wait_for("dashboard", lambda: cluster.exists("ConfigMap", "prune-dashboard"))
    cluster.patch_finetune("prune", {"spec": {"monitoring": {"dcgm": {"enabled": False}}}})
    wait_for("alerts pruned", lambda: custom(cluster, "prometheusrules", "prune-alerts") is None)
    wait_for("dashboard pruned", lambda: not cluster.exists("ConfigMap", "prune-dashboard"))
    assert custom(cluster, "podmonitors", "prune-trainer") is not None, "the trainer's PodMonitor is still wanted"
    assert cluster.exists("ConfigMap", "prune-config")
    assert cluster.status("prune")["attempt"] == 1
    events = wait_for("event", lambda: [e["message"] for e in cluster.events("prune") if e["reason"] == "ChildrenApplied"
                                        and "pruned" in e["message"]])
    assert "PrometheusRule prune-alerts" in events[-1] and "ConfigMap prune-dashboard" in events[-1]


def test_a_deleted_or_edited_etcd_service_is_repaired(cluster: Cluster, operator: Operator) -> None:
    started(cluster, "repair", tiny_spec(rendezvous=ETCD))
    service = cluster.core.read_namespaced_service("repair-etcd", cluster.ns)
    port = service.spec.ports[0].port
    cluster.core.patch_namespaced_service("repair-etcd", cluster.ns, {"spec": {"ports": [{"name": "client", "port": 1234}]}})
    wait_for("port repaired", lambda: cluster.core.read_namespaced_service("repair-etcd", cluster.ns).spec.ports[0].port == port)
    cluster.core.delete_namespaced_service("repair-etcd", cluster.ns)
    wait_for("re-created", lambda: cluster.exists("Service", "repair-etcd"))
    assert "DriftRepaired" in wait_for("event", lambda: reasons(cluster, "repair"))
    assert cluster.status("repair")["attempt"] == 1


def test_a_new_etcd_image_rolls_out_without_a_new_attempt(etcd: LocalEtcd, tmp_path: Path) -> None:
    """The etcd image is the operator's setting: upgrading the operator updates every managed etcd.
    (Its own emulator: the module's operator must not run beside these two.)"""
    def image(own: Cluster) -> str:
        return str(own.apps.read_namespaced_deployment("upgrade-etcd", own.ns).spec.template.spec.containers[0].image)

    with own_emulator(tmp_path) as (own, kubeconfig):
        op = Operator(kubeconfig, tmp_path / "a.log", LLAMAFT_ETCD_IMAGE="quay.io/coreos/etcd:v3.5.16",
                      LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE=etcd.endpoint).start()
        try:
            started(own, "upgrade", tiny_spec(rendezvous=ETCD))
        finally:
            op.stop()
        assert image(own) == "quay.io/coreos/etcd:v3.5.16"
        op = Operator(kubeconfig, tmp_path / "b.log", LLAMAFT_ETCD_IMAGE="quay.io/coreos/etcd:v3.5.17",
                      LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE=etcd.endpoint).start()
        try:
            wait_for("new image", lambda: image(own) == "quay.io/coreos/etcd:v3.5.17")
            assert own.status("upgrade")["attempt"] == 1 and own.attempt_job("upgrade", 2) is None
        finally:
            op.stop()


def test_applied_children_are_those_whose_version_the_apply_changed() -> None:
    """children.changed_children: an apply that writes nothing returns a version already seen (by
    this process's last apply, or in the watch's copy of the object); only a write makes a new one."""
    from llamaft.operator.children import changed_children, live_versions

    cm, dep, svc = ("ConfigMap", "x-config"), ("Deployment", "x-etcd"), ("Service", "x-etcd")
    after = {cm: "10", dep: "15", svc: "12"}
    assert changed_children(after, {}) == ["ConfigMap x-config", "Deployment x-etcd", "Service x-etcd"], "nothing known"
    # A restarted operator applied nothing yet; the watch shows every child as the apply finds it.
    assert changed_children(after, {}, {cm: "10", dep: "15", svc: "12"}) == []
    # The Deployment's status moved its version after our apply (10 -> 15); the apply is a no-op.
    assert changed_children(after, {cm: "10", dep: "11", svc: "12"}, {dep: "15"}) == []
    # The watch has not caught up with our last apply: that apply's version still counts as seen.
    assert changed_children(after, {cm: "10", dep: "15", svc: "12"}, {cm: "7"}) == []
    # A hand edit (12) repaired by this apply (13), a spec change (10 -> 16), a child re-created.
    assert changed_children({cm: "16", dep: "15", svc: "13"}, {cm: "10", dep: "15", svc: "11"}, {svc: "12"}) == [
        "ConfigMap x-config", "Service x-etcd"]
    assert changed_children({svc: "20"}, {svc: "11"}, {}) == ["Service x-etcd"]
    listed = {"Service": [{"metadata": {"name": "x-etcd", "resourceVersion": "12"}}],
              "ConfigMap": [{"metadata": {"name": "y", "resourceVersion": None}}], "Deployment": []}
    assert live_versions(listed) == {svc: "12"}


def test_a_restart_or_a_status_change_applies_nothing_and_says_so(etcd: LocalEtcd, tmp_path: Path) -> None:
    """Issue 24: an operator restarted mid-run posted a second ChildrenApplied listing every
    unchanged child, and the managed etcd Deployment's status update (it became ready) posted
    "applied Deployment ...". Events that say something happened when nothing did teach users to
    ignore events. Only a change (here the scrape selector's labels) is reported, with what it
    changed."""
    def applied(own: Cluster) -> list[str]:
        """Every event that says children were applied: their own, or a start's JobCreated, which
        names them when the job is created in the same step (whether the etcd Deployment is ready by
        then decides which of the two the first apply is said in)."""
        events = sorted(own.events("quiet"), key=lambda e: str(e.get("firstTimestamp") or e["metadata"]["creationTimestamp"]))
        return [f'{e["reason"]}: {e["message"]}' for e in events if e["reason"] in ("ChildrenApplied", "DriftRepaired")
                or (e["reason"] == "JobCreated" and "; applied " in e["message"])]

    with own_emulator(tmp_path) as (own, kubeconfig):
        env = {"LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE": etcd.endpoint}
        op = Operator(kubeconfig, tmp_path / "a.log", **env).start()
        try:
            started(own, "quiet", tiny_spec(rendezvous=ETCD))  # and the etcd Deployment's status says ready
            own.wait_reasons("quiet", "JobCreated")
            before = applied(own)
        finally:
            op.stop()
        assert before and "Deployment quiet-etcd" in before[0] and "ConfigMap quiet-config" in before[0]
        op = Operator(kubeconfig, tmp_path / "b.log", **env).start()
        try:
            own.make_etcd_ready("quiet-etcd")  # another status-only write
            own.patch_finetune("quiet", {"spec": {"monitoring": {"dcgm": {"scrapeSelector": {"team": "nlp"}}}}})
            wait_for("relabelled", lambda: len(applied(own)) > len(before))
            after = applied(own)[len(before):]
        finally:
            op.stop()
    assert len(after) == 1 and "PodMonitor quiet-trainer" in after[0], after
    assert not any(f"{kind} quiet-" in after[0] for kind in ("Deployment", "Service")), after
    # The ConfigMap did change: it carries the whole spec (spec.json, the trackers' params).
    assert "ConfigMap quiet-config" in after[0], after


def test_deletion_is_left_to_the_garbage_collector(kubeconfig: Path, cluster: Cluster, operator: Operator,
                                                  emulator: EmulatorThread) -> None:
    started(cluster, "collected", tiny_spec(rendezvous=ETCD))
    wait_for("monitoring", lambda: custom(cluster, "podmonitors", "collected-trainer"))
    seen = len(emulator.requests())
    cluster.delete_finetune("collected")
    wait_for("all children gone", lambda: not any((
        cluster.jobs("llamaft.io/finetune=collected"), cluster.exists("ConfigMap", "collected-config"),
        cluster.exists("Deployment", "collected-etcd"), cluster.exists("Service", "collected-etcd"),
        custom(cluster, "podmonitors", "collected-trainer"), custom(cluster, "prometheusrules", "collected-alerts"))) or None)
    deletes = [r.path for r in emulator.requests()[seen:] if r.method == "DELETE" and r.user_agent == USER_AGENT]
    assert deletes == [], "the operator deletes nothing itself: every child is owned by the LlamaFineTune"
    assert any(r.method == "DELETE" and r.path.endswith("/llamafinetunes/collected") for r in emulator.requests()[seen:])
