"""The operator's typed read of a stored status (status.read_status) and the way parts of it go back
into a merge patch (status.as_written): lenient on what it cannot use, exact on what it keeps."""

from __future__ import annotations

from typing import Any

from llamaft.api.status import LlamaFineTuneStatus, Phase, as_written, read_status

RECORD = {"attempt": 1, "reason": "Killed", "retryable": True, "step": 4, "time": "2026-11-30T12:00:00Z"}
CONDITION = {"type": "Running", "status": "True", "reason": "PyTorchJobRunning", "message": "",
             "lastTransitionTime": "2026-11-30T12:00:00Z", "observedGeneration": 2}


def test_a_status_is_read_typed_and_its_parts_go_back_exactly_as_stored() -> None:
    stored: dict[str, Any] = {"phase": "Running", "attempt": 2, "retriesUsed": 1, "progress": {"step": 7, "totalSteps": 60},
                              "failures": [RECORD], "conditions": [CONDITION], "leaderPod": "p-worker-0"}
    st = read_status(stored)
    assert st.phase is Phase.RUNNING and st.attempt == 2 and st.retries_used == 1 and st.leader_pod == "p-worker-0"
    assert st.progress.step == 7 and st.failures[0].reason == "Killed" and st.conditions[0].observed_generation == 2
    # No default the stored object did not have (message "" of a record, the progress fields unset).
    assert as_written(st.progress) == stored["progress"]
    assert [as_written(f) for f in st.failures] == [RECORD]
    assert [as_written(c) for c in st.conditions] == [CONDITION]
    assert read_status(st) is st


def test_an_absent_or_empty_status_is_a_new_run() -> None:
    for raw in (None, {}):
        st = read_status(raw)
        assert st == LlamaFineTuneStatus() and st.attempt == 0 and st.phase is Phase.PENDING


def test_what_it_cannot_use_is_left_out_and_the_rest_is_kept() -> None:
    st = read_status({"phase": "Running", "attempt": 3, "fromAnotherVersion": {"x": 1}, "progress": {"step": 5, "newKey": 1},
                      "retriesUsed": "many", "failures": [{"attempt": i, **{k: v for k, v in RECORD.items() if k != "attempt"}}
                                                          for i in range(30)],
                      "excludedNodes": [f"n{i}" for i in range(20)]})
    assert st.phase is Phase.RUNNING and st.attempt == 3 and st.progress.step == 5
    assert st.retries_used == 0 and "retriesUsed" not in st.model_fields_set, "a field that does not validate is unset"
    assert [f.attempt for f in st.failures] == list(range(10, 30)), "a bounded list keeps its newest entries"
    assert st.excluded_nodes == [f"n{i}" for i in range(4, 20)]
