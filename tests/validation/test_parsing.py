"""`llamaft validate` and `llamaft render` on hostile or unusual files: every document checked, one
message naming the line or the field, never a traceback, bounded output, quickly."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from llamaft.api.documents import MAX_FILE_BYTES, parse_documents
from llamaft.cli import main

from tests.validation.test_error_messages import base, with_

GOOD = yaml.safe_dump(base(), sort_keys=False)


def run(tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes | str, *args: str) -> tuple[int, str, float]:
    """(exit code, output, CPU seconds the validation took). CPU time, not wall time: the bound
    is on the work done (no quadratic or expanding path), which a loaded machine (the suite's
    other workers) does not change; wall time it does."""
    path = tmp_path / "f.yaml"
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    start = time.process_time()
    code = main([*(args or ("validate",)), str(path)])
    elapsed = time.process_time() - start
    captured = capsys.readouterr()
    out = (captured.out + captured.err).replace(str(path), "F")
    assert "Traceback" not in out
    assert len(out) < 100_000
    return code, out, elapsed


def nested(levels: int, leaf: str = "1") -> str:
    return "{a: " * levels + leaf + "}" * levels


def spec_with_overrides(value: str) -> str:
    return ("apiVersion: llamaft.io/v1alpha1\nkind: LlamaFineTune\nmetadata: {name: ok}\n"
            "spec: {model: {source: meta-llama/Llama-2-7b-hf}, dataset: {format: samsum, source: knkarthick/samsum}, "
            f"checkpointing: {{discardWithPod: true}}, cluster: {{workers: 2, podTemplateOverrides: {value}}}}}\n")


CLAIM = ("apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: results}\n"
         "spec: {accessModes: [ReadWriteMany], resources: {requests: {storage: 100Gi}}}\n")

BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))


# (case, file content, extra CLI args, exit code, exact output lines that must appear)
CASES: list[tuple[str, Any, tuple[str, ...], int, list[str]]] = [
    ("second document of another kind", GOOD + "---\n" + yaml.safe_dump({**base(), "kind": "PyTorchJob"}), (), 0,
     ["F: ok (ok: 2 worker(s) x 8 GPU(s), FULL_SHARD, bf16)",
      "F#1: not checked: a PyTorchJob llamaft.io/v1alpha1 (line 16); llamaft validate checks LlamaFineTune documents only"]),
    ("a claim for the results beside the fine-tune, as kubectl applies it", CLAIM + "---\n" + GOOD, (), 0,
     ["F: not checked: a PersistentVolumeClaim v1 (line 1); llamaft validate checks LlamaFineTune documents only",
      "F#1: ok (ok: 2 worker(s) x 8 GPU(s), FULL_SHARD, bf16)"]),
    ("a claim beside a broken fine-tune", CLAIM + "---\n" + yaml.safe_dump(with_(("spec.cluster.workers", "2"))), (), 1,
     ["F: not checked: a PersistentVolumeClaim v1 (line 1); llamaft validate checks LlamaFineTune documents only",
      "F#1: spec.cluster.workers: must be an integer, got the string '2' (write 2 without quotes)"]),
    ("only other kinds", CLAIM, (), 1,
     ["F: not checked: a PersistentVolumeClaim v1 (line 1); llamaft validate checks LlamaFineTune documents only",
      "F: no LlamaFineTune document found (kind: LlamaFineTune)"]),
    ("render: a document of another kind", CLAIM, ("render",), 1,
     ["error: kind: this document (line 1) is a 'PersistentVolumeClaim' 'v1', not a LlamaFineTune: give a file whose "
      "document is a LlamaFineTune"]),
    ("second document with another apiVersion", GOOD + "---\n" + yaml.safe_dump({**base(), "apiVersion": "llamaft.io/v1"}),
     (), 1, ["F#1: apiVersion: must be 'llamaft.io/v1alpha1', got 'llamaft.io/v1'"]),
    ("second document a scalar", GOOD + "---\njust a string\n", (), 1,
     ["F#1: document at line 16: must be a LlamaFineTune mapping (apiVersion, kind, metadata, spec), got the string "
      "'just a string'"]),
    ("invalid UTF-8", GOOD.replace("knkarthick", "kn\udcffkarthick").encode("utf-8", "surrogateescape"), (), 1,
     ["F: line 10, column 15: byte 0xff is not valid UTF-8: save the file as UTF-8"]),
    ("UTF-16 with a byte-order mark", GOOD.encode("utf-16"), (), 0, ["F: ok (ok: 2 worker(s) x 8 GPU(s), FULL_SHARD, bf16)"]),
    ("UTF-16 without a byte-order mark", GOOD.encode("utf-16-le"), (), 1,
     ["F: the file looks like UTF-16 without a byte-order mark: save it as UTF-8"]),
    ("UTF-8 with a byte-order mark", b"\xef\xbb\xbf" + GOOD.encode(), (), 0, ["F: ok (ok: 2 worker(s) x 8 GPU(s), FULL_SHARD, bf16)"]),
    ("not YAML", "spec: [unclosed\n", (), 1,
     ["F: not valid YAML: line 2, column 1: did not find expected ',' or ']' (while parsing a flow sequence)"]),
    ("nested past kubectl's limit, as a document", nested(10_001) + "\n", (), 1, ["F: line 1: nested deeper than 10000 levels"]),
    ("nested past kubectl's limit, as a field", spec_with_overrides(nested(10_001)), (), 1,
     ["F: line 4: nested deeper than 10000 levels"]),
    ("billion laughs", BOMB, (), 1,
     ["F: document at line 1: larger than 1536 KiB as JSON once its YAML aliases (*name) are expanded: the API server "
      "stores at most 1.5 MiB per object"]),
    ("billion laughs as a second document", GOOD + "---\n" + BOMB, (), 1,
     ["F#1: document at line 16: larger than 1536 KiB as JSON once its YAML aliases (*name) are expanded: the API "
      "server stores at most 1.5 MiB per object"]),
    ("a recursive alias", "a: &a [*a]\n", (), 1, ["F: line 1: alias *a refers to a node that contains it (a recursive alias)"]),
    ("a duplicate key", GOOD.replace("  cluster:\n", "  cluster:\n    workers: 3\n"), (), 1,
     ["F: line 13: key 'workers' appears twice in this mapping (kubectl rejects duplicate keys)"]),
    ("a Python tag", "a: !!python/object/apply:os.system [echo]\n", (), 1,
     ["F: line 1: unsupported YAML tag 'tag:yaml.org,2002:python/object/apply:os.system': use plain mappings and lists"]),
    ("too large a file", "a: " + "x" * MAX_FILE_BYTES + "\n", (), 1,
     ["F: 3,145,732 bytes; at most 3,145,728 are read (the API server's request limit is 3 MiB)"]),
    ("nested 500 levels, admitted", spec_with_overrides("{x: " + nested(500) + "}"), ("validate", "--schema-only"), 0,
     ["F: ok (ok: 2 worker(s) x 8 GPU(s), FULL_SHARD, bf16)"]),
    ("nested 2000 levels, admitted", spec_with_overrides("{x: " + nested(2000) + "}"), ("validate", "--schema-only"), 0,
     ["F: ok (ok: 2 worker(s) x 8 GPU(s), FULL_SHARD, bf16)"]),
    ("nested 2000 levels, but no pod field nests so", spec_with_overrides("{x: " + nested(2000) + "}"), (), 1,
     ["F: spec.cluster.podTemplateOverrides.x.a.a.a.a.a.a.a.a.a.a.a…: nested more than 64 levels deep; no field of a pod "
      "template nests that deep: remove it"]),
    ("YAML 1.1 spellings as kubectl reads them", GOOD.replace("workers: 2", "workers: 0x2"), (), 0,
     ["F: ok (ok: 2 worker(s) x 8 GPU(s), FULL_SHARD, bf16)"]),
    ("2e-5 is a number for kubectl (PyYAML reads a string)",
     GOOD.replace("  cluster:", "  training: {epochs: 1, learningRate: 2e-5}\n  cluster:"), (), 0,
     ["F: ok (ok: 2 worker(s) x 8 GPU(s), FULL_SHARD, bf16)"]),
    ("a quoted number stays a string", GOOD.replace("workers: 2", "workers: '2'"), (), 1,
     ["F: spec.cluster.workers: must be an integer, got the string '2' (write 2 without quotes)"]),
    ("y is a boolean for kubectl", GOOD.replace("  cluster:", "  dataset2: y\n  cluster:"), (), 1,
     ["F: spec.dataset2: unknown field; did you mean 'dataset'? known fields: backend, cache, checkpointing, cluster, dataset, evaluation, fsdp, "
      "model, monitoring, preflight, rendezvous, runPolicy, scheduling, tracking, trainJob, training"]),
    ("packing: y", GOOD.replace("format: samsum", "format: samsum\n    packing: y"), (), 0,
     ["F: ok (ok: 2 worker(s) x 8 GPU(s), FULL_SHARD, bf16)"]),
    ("a timestamp stays a string", GOOD.replace("knkarthick/samsum", "2024-01-01"), (), 0,
     ["F: ok (ok: 2 worker(s) x 8 GPU(s), FULL_SHARD, bf16)"]),
    ("an empty file", "", (), 1, ["F: no LlamaFineTune document found (kind: LlamaFineTune)"]),
    ("render: pvc:/// model", yaml.safe_dump(with_(("spec.model.source", "pvc:///models/x"))), ("render",), 1,
     ["error: spec.model.source: pvc:// sources look like pvc://<claim>/<path>, with <claim> the name of a "
      "PersistentVolumeClaim in this namespace (lowercase letters, digits, '-' and '.'), e.g. pvc://models/llama-2-7b"]),
    ("render: pvc:/// dataset", yaml.safe_dump(with_(("spec.dataset.source", "pvc:///data/x.jsonl"))), ("render",), 1,
     ["error: spec.dataset.source: pvc:// sources look like pvc://<claim>/<path>, with <claim> the name of a "
      "PersistentVolumeClaim in this namespace (lowercase letters, digits, '-' and '.'), e.g. pvc://models/llama-2-7b"]),
    ("render: pvc:/// tokenizer", yaml.safe_dump(with_(("spec.model.tokenizer", "pvc:///tok"))), ("render",), 1,
     ["error: spec.model.tokenizer: pvc:// sources look like pvc://<claim>/<path>, with <claim> the name of a "
      "PersistentVolumeClaim in this namespace (lowercase letters, digits, '-' and '.'), e.g. pvc://models/llama-2-7b"]),
    ("render: values near 10^30 name the field", GOOD.replace("workers: 2", "workers: 1.0e+30"), ("render",), 1,
     ["error: spec.cluster.workers: must be an integer, got the number 1e+30 (too large for an integer)"]),
    ("render: a broken child", yaml.safe_dump(with_(("spec.cluster.podTemplateOverrides", {"spec": {"containers": "x"}}))),
     ("render",), 1,
     ["error: spec.cluster.podTemplateOverrides.spec.containers: must be of type array, got 'x' (in the PyTorchJob "
      "ok-ffff-1, spec.pytorchReplicaSpecs.Worker.template.spec.containers): fix or remove it in podTemplateOverrides "
      "(merged into the worker pod template as a strategic merge patch: containers, volumes and env by name)"]),
]


def _case_name(data: Any) -> str:
    return next(c[0] for c in CASES if c[1] is data)


@pytest.mark.parametrize(("data", "args", "code", "lines"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_files(tmp_path: Path, capsys: pytest.CaptureFixture[str], data: Any, args: tuple[str, ...], code: int,
               lines: list[str]) -> None:
    got, out, elapsed = run(tmp_path, capsys, data, *args)
    assert got == code, out
    for line in lines:
        assert line in out.splitlines(), out
    # Typically 1-60 ms; past 1000 levels libyaml gives up and the pure-Python parser takes over:
    # 10,000 levels take it about 0.4-0.6 s on an idle core (bounds leave room for a busy CI machine).
    assert elapsed < (3.0 if "nested" in _case_name(data) else 1.5)


@pytest.mark.parametrize(("text", "value"), [
    ("2e-5", 2e-5), ("1e30", 1e30), ("2.0e-5", 2e-5), (".5", 0.5), ("1.", 1.0), ("y", True), ("Off", False),
    ("~", None), ("0o17", 15), ("010", 8), ("08", 8.0), ("0x1F", 31), ("0b101", 5), ("1_000", 1000), ("+5", 5),
    ("1:30", "1:30"), ("2024-01-01", "2024-01-01"), ("1e400", "1e400"), ("18446744073709551615", 2**64 - 1),
    ("99999999999999999999999", 1e23), ("abc", "abc"),
])
def test_plain_scalars_resolve_as_kubectl_reads_them(text: str, value: Any) -> None:
    """go-yaml v2 (sigs.k8s.io/yaml), not PyYAML: what kubectl sends is what is validated."""
    from llamaft.api.documents import resolve_plain

    got = resolve_plain(text)
    assert got == value and type(got) is type(value)


def test_every_document_is_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = [base(), with_(("spec.cluster.workers", "2")), base(), {**base(), "kind": "Secret", "apiVersion": "v1"}]
    code, out, _ = run(tmp_path, capsys, yaml.safe_dump_all(docs))
    assert code == 1
    assert [line.split(":")[0] for line in out.splitlines() if not line.startswith("  ")] == ["F", "F#1", "F#2", "F#3"]


def test_many_errors_are_bounded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def cost(n: int) -> tuple[int, str, float]:
        obj = base()
        obj["spec"]["cluster"].update({f"unknown{i}": i for i in range(n)})
        obj["spec"]["model"]["revision"] = "x" * (200 * n)
        return run(tmp_path, capsys, yaml.safe_dump(obj))

    _, _, small = cost(500)
    code, out, big = cost(5000)
    assert code == 1 and out.splitlines()[-1] == "F: ... and 4951 more errors"
    # Ten times the input, at most ~ten times the work (a quadratic path would be a hundred): a
    # ratio of two runs side by side, not a wall-clock bound a loaded machine breaks.
    assert big < 25 * small + 0.2


def test_alias_bombs_are_refused_without_expanding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    quadratic = "a: &a [" + ",".join(["x" * 100] * 100) + "]\n" + "".join(f"k{i}: *a\n" for i in range(1000))
    for data in (BOMB, quadratic, "k: &k {" + ", ".join(f"x{i}: *k" for i in range(0)) + "}\n" + BOMB):
        code, out, elapsed = run(tmp_path, capsys, data)
        assert code == 1 and "YAML aliases" in out and elapsed < 0.5, out


def test_aliases_within_the_limit_are_fine() -> None:
    text = "x: &r {requests: {cpu: '1'}}\n" + GOOD
    assert parse_documents(text.encode(), "f")[0].errors == []


def test_nulls_are_pruned_in_the_cli_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = GOOD.replace("workers: 2", "workers: null") + "  fsdp: null\n  training: ~\n"
    code, out, _ = run(tmp_path, capsys, text)
    assert code == 0 and "F: ok (ok: 1 worker(s) x 8 GPU(s), FULL_SHARD, bf16)" in out


def test_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(GOOD.encode())))
    assert main(["validate", "-"]) == 0
    assert capsys.readouterr().out.startswith("-: ok (ok: 2 worker(s)")


DEEP = 100_000


@pytest.mark.parametrize(("where", "text", "line"), [
    ("a document of nested lists", "[" * DEEP + "]" * DEEP + "\n", 1),
    ("nested lists inside spec", spec_with_overrides("{x: " + "[" * DEEP + "]" * DEEP + "}"), 4),
    ("nested block lists", "- " * DEEP + "x\n", 1),
])
def test_100000_levels_are_refused_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, text: str,
                                           line: int) -> None:
    """100,000 levels are refused as soon as the parser passes kubectl's 10,000 (once took minutes:
    PyYAML's scanner walked every open level's possible key for each token, and the refused
    document was then parsed to its end)."""
    code, out, elapsed = run(tmp_path, capsys, text + GOOD.join(["---\n", ""]))
    assert code == 1, out
    assert f"F: line {line}: nested deeper than 10000 levels" in out.splitlines(), out
    assert ("F: document at line 1: kubectl and the API server refuse objects nested deeper than 10000 levels; the "
            "rest of the file is not read") in out.splitlines(), out
    # Ten times past the limit costs what just past it does: a ratio of two runs side by side
    # (CPU time, not wall time); no absolute bound, which would measure the machine.
    _, _, at_limit = run(tmp_path, capsys, text.replace("[" * DEEP, "[" * 10_001).replace("]" * DEEP, "]" * 10_001)
                         .replace("- " * DEEP, "- " * 10_001))
    assert elapsed < 3 * at_limit + 0.5, (elapsed, at_limit)


_EVENT_CASES = [
    *(p.read_text() for p in sorted(Path("examples").glob("*.yaml"))),
    GOOD, BOMB, nested(50), "[" * 1500 + "]" * 1500, "{" + ", ".join(f"k{i}: [" * 3 + "1" + "]" * 3 for i in range(400)) + "}",
    "{" + "a" * 1100 + ": 1}", "[" * 300 + "\n" + "x: 1" + "]" * 300, "a:\n  b: [1,\n    2]\n  c: {d: e,\n f: g}\n",
    "? [a, b]\n: c\n", "- [a, {b: c}, [d, e: f]]\n", "x: [&a 1, *a, !!str 2]\n---\ny: z\n...\n",
]


@pytest.mark.parametrize("text", _EVENT_CASES, ids=range(len(_EVENT_CASES)))
def test_the_linear_scanner_reads_what_pyyaml_reads(text: str) -> None:
    """documents._PyLoader changes how PyYAML's scanner finds its possible simple keys, not what
    it finds: the same events (or the same error) as yaml.SafeLoader's, on the examples and on
    flow collections deep, long, wide and spread over lines."""
    from llamaft.api.documents import _PyLoader

    def events(loader: type) -> list[Any]:
        try:
            return [(type(e).__name__, getattr(e, "value", None), getattr(e, "anchor", None), getattr(e, "tag", None),
                     getattr(e.start_mark, "index", None), getattr(e.end_mark, "index", None)) for e in yaml.parse(text, Loader=loader)]
        except yaml.YAMLError as exc:
            return [str(exc)]

    assert events(_PyLoader) == events(yaml.SafeLoader)


@pytest.mark.parametrize("text", ["{a: b\nc: d}\n", "x: 1\ny\nz: 2\n", "a: [b\n c: d\n", "k" * 1030 + ": v\n",
                                  "a:\n  b\n  c: d\n"])
def test_the_linear_scanner_errs_as_pyyaml_does(text: str) -> None:
    from llamaft.api.documents import _PyLoader

    def error(loader: type) -> str:
        try:
            list(yaml.parse(text, Loader=loader))
        except yaml.YAMLError as exc:
            return str(exc)
        return "no error"

    assert error(_PyLoader) == error(yaml.SafeLoader)
