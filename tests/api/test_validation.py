"""Bad input is rejected with a message naming the field; good input passes; CLI == cluster rules."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from llamaft.api import crd as crdgen
from llamaft.api.validation import SpecInvalid, cel_errors, validate_resource
from llamaft.cli import main

from tests.conftest import EXAMPLES


def base() -> dict[str, Any]:
    return {
        "apiVersion": "llamaft.io/v1alpha1",
        "kind": "LlamaFineTune",
        "metadata": {"name": "ok"},
        "spec": {
            "model": {"source": "meta-llama/Llama-2-7b-hf"},
            "dataset": {"format": "samsum", "source": "knkarthick/samsum"},
            "cluster": {"workers": 2, "gpusPerWorker": 8},
        },
    }


def with_(path: str, value: Any) -> dict[str, Any]:
    """`base()` with `path` (dot separated, under the object root) set; value None deletes it."""
    obj = base()
    *parents, leaf = path.split(".")
    node = obj
    for part in parents:
        node = node.setdefault(part, {})
    if value is None:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return obj


HYBRID_3 = {"shardingStrategy": "HYBRID_SHARD", "hybridShard": {"shardGroupSize": 3, "replicaGroupSize": 2}}

# (object, path the error must name, words the message must contain)
BROKEN: list[tuple[str, dict[str, Any], str, str]] = [
    ("wrong apiVersion", with_("apiVersion", "llamaft.io/v1"), "apiVersion", "llamaft.io/v1alpha1"),
    ("wrong kind", with_("kind", "PyTorchJob"), "kind", "LlamaFineTune"),
    ("no name", with_("metadata.name", None), "metadata.name", "required"),
    ("name not DNS-1035", with_("metadata.name", "Llama_7B"), "metadata.name", "DNS-1035"),
    ("name too long", with_("metadata.name", "a" * 43), "metadata.name", "at most 42"),
    ("no spec", with_("spec", None), "spec", "spec.model"),
    ("no model", with_("spec.model", None), "spec.model", "required field is missing"),
    ("no model source", with_("spec.model", {}), "spec.model.source", "required"),
    ("no dataset format", with_("spec.dataset", {"source": "x"}), "spec.dataset.format", "required"),
    ("unknown dataset format", with_("spec.dataset.format", "csv"), "spec.dataset.format", "samsum, alpaca, jsonl"),
    ("unknown dataset field", with_("spec.dataset.maxSeqLen", 1024), "spec.dataset.maxSeqLen", "did you mean 'maxSeqLength'"),
    ("unknown top-level spec field", with_("spec.fdsp", {}), "spec.fdsp", "did you mean 'fsdp'"),
    ("typo in strategy", with_("spec.fsdp", {"shardingStrategy": "FULL"}), "spec.fsdp.shardingStrategy", "FULL_SHARD, HYBRID_SHARD"),
    ("bad precision", with_("spec.fsdp", {"mixedPrecision": "int8"}), "spec.fsdp.mixedPrecision", "bf16, fp16, fp32, pure-bf16"),
    ("bad AC mode", with_("spec.fsdp", {"activationCheckpointing": {"mode": "some"}}), "spec.fsdp.activationCheckpointing.mode", "none, full, selective"),
    ("AC every 0 layers", with_("spec.fsdp", {"activationCheckpointing": {"mode": "selective", "everyNLayers": 0}}), "spec.fsdp.activationCheckpointing.everyNLayers", "greater than or equal to 1"),
    ("hybrid group does not divide", with_("spec.fsdp", HYBRID_3), "spec.fsdp.hybridShard.shardGroupSize", "shardGroupSize must divide workers x gpusPerWorker (the world size)"),
    ("hybrid groups do not multiply", with_("spec.fsdp", {"shardingStrategy": "HYBRID_SHARD", "hybridShard": {"shardGroupSize": 8, "replicaGroupSize": 4}}), "spec.fsdp.hybridShard", "shardGroupSize x replicaGroupSize must equal workers x gpusPerWorker (the world size)"),
    ("hybridShard without HYBRID_SHARD", with_("spec.fsdp", {"hybridShard": {"shardGroupSize": 8, "replicaGroupSize": 2}}), "spec.fsdp.hybridShard", "only applies when shardingStrategy is HYBRID_SHARD"),
    ("cpu offload with NO_SHARD", with_("spec.fsdp", {"shardingStrategy": "NO_SHARD", "cpuOffload": True}), "spec.fsdp.cpuOffload", "NO_SHARD"),
    ("both epochs and maxSteps", with_("spec.training", {"epochs": 1, "maxSteps": 10}), "spec.training", "exactly one of epochs or maxSteps"),
    ("neither epochs nor maxSteps", with_("spec.training", {"learningRate": 1e-5}), "spec.training", "exactly one of epochs or maxSteps"),
    ("zero learning rate", with_("spec.training", {"epochs": 1, "learningRate": 0}), "spec.training.learningRate", "greater than 0"),
    ("negative batch", with_("spec.training", {"epochs": 1, "perDeviceBatchSize": -1}), "spec.training.perDeviceBatchSize", "greater than or equal to 1"),
    ("bad scheduler", with_("spec.training", {"epochs": 1, "scheduler": "step"}), "spec.training.scheduler", "cosine, linear, constant"),
    ("LoRA without targets", with_("spec.training", {"epochs": 1, "lora": {"targetModules": []}}), "spec.training.lora.targetModules", "at least one module"),
    ("LoRA with fsdp1", {**with_("spec.training", {"epochs": 1, "lora": {}}), }, "", ""),  # replaced below
    ("DoRA on the embeddings", with_("spec.training", {"epochs": 1, "lora": {"useDora": True, "targetModules": ["q_proj", "embed_tokens"]}}),
     "spec.training.lora.targetModules", "useDora applies to linear layers only: remove embed_tokens"),
    ("DoRA on a qualified embeddings name", with_("spec.training", {"epochs": 1, "lora": {"useDora": True, "targetModules": ["model.embed_tokens"]}}),
     "spec.training.lora.targetModules", "useDora applies to linear layers only"),
    ("elastic min > max", with_("spec.cluster.elastic", {"minWorkers": 4, "maxWorkers": 2}), "spec.cluster.elastic.minWorkers", "minWorkers must be <= maxWorkers"),
    ("workers outside elastic", with_("spec.cluster.elastic", {"minWorkers": 4, "maxWorkers": 8}), "spec.cluster.workers", "workers must lie within elastic.minWorkers..maxWorkers"),
    ("zero workers", with_("spec.cluster.workers", 0), "spec.cluster.workers", "greater than or equal to 1"),
    ("EFA without GPUs", with_("spec.cluster", {"gpusPerWorker": 0, "efaDevicesPerWorker": 4}), "spec.cluster.efaDevicesPerWorker", "needs GPU workers"),
    ("bad memory quantity", with_("spec.cluster.resources", {"memory": "lots"}), "spec.cluster.resources.memory", "must be a Kubernetes quantity greater than 0"),
    ("bad toleration effect", with_("spec.cluster.tolerations", [{"key": "a", "effect": "Never"}]), "spec.cluster.tolerations[0].effect", "must be one of NoSchedule, PreferNoSchedule, NoExecute"),
    ("workers as string", with_("spec.cluster.workers", "two"), "spec.cluster.workers", "must be an integer, got the string 'two'"),
    ("bad rendezvous backend", with_("spec.rendezvous", {"backend": "zookeeper"}), "spec.rendezvous.backend", "etcd-v2, etcd, c10d"),
    ("c10d with etcd endpoint", with_("spec.rendezvous", {"backend": "c10d", "endpoint": "etcd:2379"}), "spec.rendezvous.endpoint", "c10d rendezvouses on worker 0"),
    ("endpoint without port", with_("spec.rendezvous", {"endpoint": "etcd.example.com"}), "spec.rendezvous.endpoint", "must be host:port with a port from 1 to 65535"),
    ("jsonl without template", with_("spec.dataset", {"format": "jsonl", "source": "/d.jsonl"}), "spec.dataset.promptTemplate", "needs promptTemplate"),
    ("seq length too small", with_("spec.dataset.maxSeqLength", 8), "spec.dataset.maxSeqLength", "greater than or equal to 16"),
    ("HF token inline", with_("spec.model.hfToken", "hf_abc"), "spec.model.hfToken", "did you mean 'hfTokenSecret'"),
    ("metrics port privileged", with_("spec.monitoring", {"metricsPort": 80}), "spec.monitoring.metricsPort", "greater than or equal to 1024"),
    ("negative retry budget", with_("spec.runPolicy", {"retryBudget": -1}), "spec.runPolicy.retryBudget", "greater than or equal to 0"),
    ("bad volume claim", with_("spec.checkpointing", {"volumeClaim": "My Claim"}), "spec.checkpointing.volumeClaim", "must be a DNS-1123 subdomain"),
    ("keep zero checkpoints", with_("spec.checkpointing", {"keepLast": 0}), "spec.checkpointing.keepLast", "greater than or equal to 1"),
    # issue 21: chat data, streaming, the download cache
    ("trainOn without chat", with_("spec.dataset.trainOn", "assistant"), "spec.dataset.format", "apply to format chat only"),
    ("chatTemplate without chat", with_("spec.dataset.chatTemplate", "llama3"), "spec.dataset.format", "apply to format chat only"),
    ("chat with a promptTemplate", with_("spec.dataset", {"format": "chat", "source": "o/d", "promptTemplate": "{x}"}),
     "spec.dataset.promptTemplate", "remove promptTemplate"),
    ("unknown trainOn", with_("spec.dataset", {"format": "chat", "source": "o/d", "trainOn": "assistants"}),
     "spec.dataset.trainOn", "assistant, lastAssistant, all"),
    ("streaming with epochs", with_("spec.dataset.streaming", True), "spec.training.maxSteps", "set training.maxSteps instead"),
    ("bad cache claim", with_("spec.cache", {"volumeClaim": "HF Cache"}), "spec.cache.volumeClaim", "must be a DNS-1123 subdomain"),
    ("checkpoints on the download cache", with_("spec.checkpointing", {"volumeClaim": "c", "directory": "/var/cache/llamaft/x"}),
     "spec.checkpointing.directory", "the download cache at /var/cache/llamaft"),
    # issue 25: topology-aware placement
    ("topology without a queue", with_("spec.scheduling", {"topology": {"level": "network.amazonaws.com/efa-block"}}),
     "spec.scheduling.topology", "set queueName to a LocalQueue"),
    ("topology with a Volcano gang", with_("spec.scheduling", {"gang": {}, "topology": {"level": "kubernetes.io/hostname"}}),
     "spec.scheduling.topology", "podGroupPolicy.volcano.networkTopology"),
    ("topology level not a label key", with_("spec.scheduling", {"queueName": "q", "topology": {"level": "efa block"}}),
     "spec.scheduling.topology.level", "must be a label key"),
    ("topology level name too long", with_("spec.scheduling", {"queueName": "q", "topology": {"level": "a/" + "b" * 64}}),
     "spec.scheduling.topology.level", "must be a label key"),
    ("topology level prefix too long", with_("spec.scheduling", {"queueName": "q", "topology": {"level": "a" * 254 + "/b"}}),
     "spec.scheduling.topology.level", "at most 253 characters"),
    ("topology without a level", with_("spec.scheduling", {"queueName": "q", "topology": {"mode": "required"}}),
     "spec.scheduling.topology.level", "required field is missing"),
    ("unknown topology mode", with_("spec.scheduling", {"queueName": "q", "topology": {"mode": "hard", "level": "x"}}),
     "spec.scheduling.topology.mode", "required, preferred"),
]
_lora_fsdp1 = with_("spec.training", {"epochs": 1, "lora": {}})
_lora_fsdp1["spec"]["fsdp"] = {"implementation": "fsdp1"}
BROKEN = [
    case if case[0] != "LoRA with fsdp1" else ("LoRA with fsdp1", _lora_fsdp1, "spec.fsdp.implementation", "fsdp2")
    for case in BROKEN
]


@pytest.mark.parametrize(("obj", "path", "words"), [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_broken_spec_is_rejected_naming_the_field(obj: dict[str, Any], path: str, words: str) -> None:
    with pytest.raises(SpecInvalid) as info:
        validate_resource(obj)
    matching = [e for e in info.value.errors if e.path == path]
    assert matching, f"no error at {path}: {info.value}"
    assert any(words in e.message for e in matching), f"{path}: {[e.message for e in matching]}"


def test_table_is_large() -> None:
    assert len(BROKEN) >= 25


def test_base_is_valid_and_minimal_defaults_suit_llama2_7b() -> None:
    spec = validate_resource(base())
    assert spec.fsdp.sharding_strategy == "FULL_SHARD" and spec.fsdp.mixed_precision == "bf16"
    assert spec.fsdp.activation_checkpointing.mode == "full"
    assert spec.rendezvous.backend == "etcd-v2" and spec.training.epochs == 1
    assert spec.world_size == 16


def test_dora_on_linear_layers_is_valid_and_lora_without_dora_may_adapt_the_embeddings() -> None:
    dora = validate_resource(with_("spec.training", {"epochs": 1, "lora": {"useDora": True, "targetModules": ["q_proj", "down_proj", "lm_head"]}}))
    assert dora.training.lora is not None and dora.training.lora.use_dora
    plain = validate_resource(with_("spec.training", {"epochs": 1, "lora": {"targetModules": ["embed_tokens"]}}))
    assert plain.training.lora is not None and not plain.training.lora.use_dora


def test_valid_hybrid_and_elastic() -> None:
    obj = with_("spec.fsdp", {"shardingStrategy": "HYBRID_SHARD", "hybridShard": {"shardGroupSize": 8, "replicaGroupSize": 2}})
    assert validate_resource(obj).fsdp.hybrid_shard is not None
    assert validate_resource(with_("spec.cluster.elastic", {"minWorkers": 1, "maxWorkers": 4})).cluster.elastic


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_validate(path: Any) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        validate_resource(doc)


def test_training_config_is_the_same_model() -> None:
    spec = validate_resource(base())
    cfg = spec.training_config()
    assert cfg.fsdp == spec.fsdp and cfg.model == spec.model
    assert "cluster" not in type(cfg).model_fields


# ------------------------------------------------------- the cluster and the CLI evaluate alike
def _rules(node: dict[str, Any]) -> list[str]:
    found = [r["rule"] for r in node.get("x-kubernetes-validations", [])]
    for child in node.get("properties", {}).values():
        found += _rules(child)
    if isinstance(node.get("items"), dict):
        found += _rules(node["items"])
    return found


def test_cel_rules_agree_with_a_second_cel_engine() -> None:
    """Every rule, on every table case that parses, gives the same verdict in cel-python and in
    the Rust `cel` engine (common-expression-language): the rules use only portable CEL."""
    cel = pytest.importorskip("cel")
    from llamaft.api.spec import LlamaFineTuneSpec
    from llamaft.api.validation import _evaluate

    schema = crdgen.spec_schema()
    compared = 0

    def walk(node: dict[str, Any], value: Any) -> None:
        nonlocal compared
        if value is None:
            return
        for rule in node.get("x-kubernetes-validations", []):
            # oldSelf = self: transition rules evaluate as on an update that changed nothing.
            ours = bool(_evaluate(rule["rule"], value, value))
            theirs = bool(cel.evaluate(rule["rule"], {"self": value, "oldSelf": value}))
            assert ours == theirs, rule["rule"]
            compared += 1
        if isinstance(value, dict):
            for key, child in node.get("properties", {}).items():
                walk(child, value.get(key))

    for _, obj, _, _ in BROKEN:
        try:
            spec = LlamaFineTuneSpec.model_validate(obj.get("spec", {}))
        except Exception:
            continue
        walk(schema, spec.to_k8s())
    assert compared > 100


def test_cel_errors_on_raw_crd_schema_match_validate() -> None:
    obj = with_("spec.fsdp", HYBRID_3)
    from llamaft.api.spec import LlamaFineTuneSpec

    spec = LlamaFineTuneSpec.model_validate(obj["spec"]).to_k8s()
    crd_spec = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert [str(e) for e in cel_errors(crd_spec, spec, "spec")] == [
        "spec.fsdp.hybridShard: shardGroupSize x replicaGroupSize must equal workers x gpusPerWorker (the world size)",
        "spec.fsdp.hybridShard.shardGroupSize: shardGroupSize must divide workers x gpusPerWorker (the world size)",
    ]


# ------------------------------------------------------------------------------------- CLI
def test_cli_validate_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", *map(str, EXAMPLES)]) == 0
    assert capsys.readouterr().out.count(": ok (") == len(EXAMPLES)


def test_cli_validate_reports_every_bad_document(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    kept = with_("spec.checkpointing", {"directory": "s3://bucket/ok"})  # the operator refuses results kept in the pod
    bad.write_text(yaml.safe_dump_all([with_("spec.fsdp", HYBRID_3), kept, with_("spec.fdsp", {})]))
    assert main(["validate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{bad}: spec.fsdp.hybridShard.shardGroupSize: shardGroupSize must divide workers x gpusPerWorker (the world size)" in out
    assert f"{bad}#1: ok" in out
    assert f"{bad}#2: spec.fdsp: unknown field; did you mean 'fsdp'?" in out


def test_cli_validate_yaml_syntax_and_missing_file(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed")
    assert main(["validate", str(broken), str(tmp_path / "absent.yaml")]) == 1
    out = capsys.readouterr().out
    assert "not valid YAML" in out and "absent.yaml" in out


def test_cli_crd_matches_committed(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.api.test_crd import CRD_FILE

    assert main(["crd"]) == 0
    assert capsys.readouterr().out == CRD_FILE.read_text()


def test_validate_does_not_mutate_input() -> None:
    obj = base()
    before = copy.deepcopy(obj)
    validate_resource(obj)
    assert obj == before


def test_immutable_fields_are_enforced_on_update_only() -> None:
    from llamaft.api.validation import validate_spec

    old = base()["spec"]
    new = copy.deepcopy(old)
    new["model"]["source"] = "meta-llama/Llama-2-13b-hf"
    validate_spec(new)  # a create has no previous object
    with pytest.raises(SpecInvalid) as info:
        validate_spec(new, old=old)
    assert [str(e) for e in info.value.errors] == [
        "spec.model.source: model.source is immutable: a run's checkpoints belong to its model; create a new LlamaFineTune"
    ]
    changed = copy.deepcopy(old)
    changed["cluster"]["workers"] = 4  # mutable
    validate_spec(changed, old=old)
    moved = copy.deepcopy(old)
    moved["checkpointing"] = {"directory": "/elsewhere"}
    with pytest.raises(SpecInvalid, match="checkpointing.directory is immutable"):
        validate_spec(moved, old=old)
