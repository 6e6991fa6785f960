"""Two verdicts on one LlamaFineTune document: the real API server's (a server-side dry-run create,
sent as kubectl sends it: JSON, `fieldValidation=Strict`) and `llamaft validate --schema-only`'s
(llamaft.api.validation.validate_resource, the function the CLI prints).

A verdict is whether the object is accepted and the fields its errors name. The server names a
field in each cause of its Status (`details.causes[].field`); a strict-decoding error (an unknown
or duplicate field) is one cause whose message names the field instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from llamaft.api.documents import parse_documents
from llamaft.api.validation import SpecInvalid, validate_resource

from tests.controlplane.cluster import ControlPlane
from tests.validation.apiserver_model import kubectl_json

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_STRICT = re.compile(r'unknown field "([^"]+)"|duplicate field "([^"]+)"')
_DECODE = re.compile(r"Go struct field ObjectMeta\.(\w+) of type")
"""A value of the wrong type in metadata fails decoding (encoding/json's UnmarshalTypeError)."""


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    fields: frozenset[str] = field(default_factory=frozenset)
    messages: tuple[str, ...] = ()
    decoding: bool = False
    """Refused before the schema is checked (while decoding: an unknown or duplicate field, a wrong
    type in metadata; or sent to a namespace that cannot exist): the server names only those
    fields; the schema and its rules were not checked."""

    def __str__(self) -> str:
        if self.accepted:
            return "accepted"
        return "rejected: " + "; ".join(self.messages)


def sendable(doc: Any) -> Any:
    """What kubectl sends for `doc` (tests/validation/apiserver_model.kubectl_json), or raises."""
    return kubectl_json(doc)


def server_verdict(plane: ControlPlane, namespace: str, doc: Any) -> Verdict:
    """A server-side dry-run create of `doc` in `namespace` (a valid namespace named in the
    document is replaced by the test's: where it lives is not part of the verdict)."""
    body = sendable(doc)
    if isinstance(body, dict) and isinstance(body.get("metadata"), dict):
        named = body["metadata"].get("namespace")
        if isinstance(named, str) and DNS_LABEL.match(named) and len(named) <= 63:
            body["metadata"]["namespace"] = namespace
        elif isinstance(named, str) and named:
            # No such namespace can exist: kubectl's request to it can never succeed.
            return Verdict(False, frozenset({"metadata.namespace"}), (f"namespace {named!r} cannot exist",), decoding=True)
    path = (f"/apis/llamaft.io/v1alpha1/namespaces/{namespace}/llamafinetunes"
            "?dryRun=All&fieldValidation=Strict&fieldManager=kubectl-client-side-apply")
    status, answer = plane.request("POST", path, body)
    if status == 201:
        return Verdict(True)
    answer = answer or {}
    causes = (answer.get("details") or {}).get("causes") or []
    # The server's note that the rules below an invalid value were not evaluated is no field's error.
    causes = [c for c in causes if "some validation rules were not checked" not in c.get("message", "")]
    fields = {c["field"] for c in causes if c.get("field")}
    messages = [f"{c.get('field', '')}: {c.get('message', '')}" for c in causes] or [str(answer.get("message"))]
    message = str(answer.get("message", ""))
    strict = False
    for match in _STRICT.finditer(message):
        fields.add(match.group(1) or match.group(2))
        strict = True
    for match in _DECODE.finditer(message):
        fields.add(f"metadata.{match.group(1)}")
        strict = True
    return Verdict(False, frozenset(fields), tuple(messages), decoding=strict)


def cli_verdict(doc: Any) -> Verdict:
    """`llamaft validate --schema-only`'s verdict on `doc` written as JSON (which kubectl and
    llamaft read as YAML, so the file means exactly the generated values): the CLI's reader, then
    the function whose errors it prints."""
    (parsed,) = parse_documents(json.dumps(doc, ensure_ascii=False).encode(), "doc.yaml")
    if parsed.errors:
        return Verdict(False, frozenset(e.path for e in parsed.errors), tuple(str(e) for e in parsed.errors))
    try:
        validate_resource(parsed.body)
    except SpecInvalid as exc:
        return Verdict(False, frozenset(e.path for e in exc.errors), tuple(str(e) for e in exc.errors))
    return Verdict(True)
