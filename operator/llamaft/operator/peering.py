"""Highly available operator: kopf peering between replicas (see docs/operations.md, "High availability").

Every replica runs `llamaft operator --peering NAME`. kopf keeps one entry per replica in the
`status` of a KopfPeering (namespaced operator: one object of that name in every watched namespace)
or a ClusterKopfPeering (cluster-wide operator): `{identity: {priority, lifetime, lastseen}}`,
refreshed by a keep-alive PATCH every `lifetime - 5..10` seconds (at least every second). A replica
that sees a live entry with a higher priority than its own pauses: its watch streams are closed and
its daemons stopped (kopf/_core/engines/peering.py process_peering_event, daemons.daemon_killer).
With `--peering` the peering is mandatory, so a replica starts paused and resumes only once it has
read the peering object and found no live replica above it. An entry is dead once `lastseen +
lifetime` has passed: a replica killed without a clean exit blocks the others for at most its
lifetime; a clean exit (SIGTERM) removes its entry at once.

Equal priorities do not break a tie: kopf pauses every replica of the same priority ("Possibly
conflicting operators with the same priority ... Pausing all operators, including self"), leaving
the cluster unserved. So each replica gets a distinct priority, and deliberately an age-ordered one:
the replica that started first ranks highest, so a restarted (or newly scheduled) replica always
joins as the standby and never preempts a healthy leader (a preemption would be a needless handover,
with a moment in which both replicas act). The priorities are negative, so an operator of kopf's
default priority 0, `kopf run --dev` (666) and `kopf freeze` (100) on the same peering outrank them.
"""

from __future__ import annotations

import random
import time

# (api group, resource, verbs): what kopf itself calls for its peering (list and watch by the
# peering observer, merge-PATCH of .status by the keep-alive and by the clean-up of dead entries;
# no GET). The chart grants exactly these, in the scope the operator runs in (tests/helm/test_chart.py).
CLUSTER_PEERING_CALLS: list[tuple[str, str, tuple[str, ...]]] = [
    ("kopf.dev", "clusterkopfpeerings", ("list", "watch", "patch")),
]
NAMESPACED_PEERING_CALLS: list[tuple[str, str, tuple[str, ...]]] = [
    ("kopf.dev", "kopfpeerings", ("list", "watch", "patch")),
]

def age_priority(now_ns: int | None = None, rng: random.Random | None = None) -> int:
    """A priority that ranks replicas by start time, the oldest highest: minus the start time in
    milliseconds, scaled by 1000, minus a random 0..999 that tells apart two replicas started in the
    same millisecond. Below 2**53 in magnitude, so every JSON reader keeps it exact."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    jitter = (rng or random.SystemRandom()).randrange(1000)
    return -((now_ns // 1_000_000) * 1000 + jitter)
