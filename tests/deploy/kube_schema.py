"""Check rendered Kubernetes objects offline, as the API server would.

Custom resources: the CRD's ``openAPIV3Schema`` turned into a JSON Schema. Fields that the schema does not
declare are rejected here (the API server would prune them silently, which hides a typo), except where
the schema says ``x-kubernetes-preserve-unknown-fields``. Core kinds: ``kubernetes-validate`` (strict).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

DATA = Path(__file__).parent / "data"
RAYCLUSTER_SCHEMA = DATA / "raycluster-v1.openapi.json"
# The Kubernetes version the core kinds are checked against (RuntimeClass scheduling, sidecar-era Pod).
KUBERNETES_VERSION = "1.33"


def openapi_to_jsonschema(node: Any) -> Any:
    """Map an OpenAPI v3 structural schema onto JSON Schema (draft 2020-12 keywords)."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: openapi_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    out.pop("nullable", None)
    return out


def raycluster_validator() -> jsonschema.Draft202012Validator:
    schema = openapi_to_jsonschema(json.loads(RAYCLUSTER_SCHEMA.read_text()))
    return jsonschema.Draft202012Validator(schema)


def raycluster_errors(obj: dict[str, Any]) -> list[str]:
    """Every schema violation of a RayCluster object, as 'path: message' lines."""
    return [
        f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in raycluster_validator().iter_errors(obj)
    ]


def core_errors(obj: dict[str, Any]) -> list[str]:
    """Violations of a core kind's schema (strict: unknown fields are errors)."""
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'/'.join(str(p) for p in e.path)}: {e.message}"]
    return []


def pod_from_template(template: dict[str, Any], name: str) -> dict[str, Any]:
    """A Pod object made of a pod template, so the core Pod schema can check it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **template.get("metadata", {})},
        "spec": template["spec"],
    }
