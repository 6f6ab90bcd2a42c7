"""A Kubernetes CRD's ``openAPIV3Schema`` as a strict JSON Schema, for ``check-jsonschema``.

    python docker/crds/crd_to_json_schema.py CRD.yaml [--version v1beta1] --out schema.json

The API server prunes or refuses fields a structural schema does not declare; a plain JSON Schema
validator allows them unless told. So every object that declares ``properties`` (and neither
``additionalProperties`` nor ``x-kubernetes-preserve-unknown-fields``) refuses others,
``apiVersion`` and ``kind`` are the CRD's own, and ``metadata`` is the part of ObjectMeta a
manifest sets. The rest of OpenAPI v3's subset (``anyOf`` of int-or-string, ``format``,
``pattern``, ``required``, ``enum``) is JSON Schema already.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

PRESERVE_UNKNOWN = "x-kubernetes-preserve-unknown-fields"
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT_META = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "generateName": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
}


def strict(node: Any) -> Any:
    """``node`` with every declared object closed to undeclared fields (a new tree)."""
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    closed = {key: strict(value) for key, value in node.items()}
    if "properties" in node and "additionalProperties" not in node and not node.get(PRESERVE_UNKNOWN):
        closed["additionalProperties"] = False
    return closed


def crd_json_schema(crd: dict[str, Any], version: str | None = None) -> dict[str, Any]:
    """The JSON Schema of ``crd``'s ``version`` (default: the storage version)."""
    versions = crd["spec"]["versions"]
    (served,) = [v for v in versions if v["name"] == version] if version else [v for v in versions if v["storage"]]
    schema = strict(served["schema"]["openAPIV3Schema"])
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    schema["properties"]["apiVersion"] = {"const": f"{group}/{served['name']}"}
    schema["properties"]["kind"] = {"const": kind}
    schema["properties"]["metadata"] = OBJECT_META
    schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind", "metadata", "spec"})
    return {"$schema": "http://json-schema.org/draft-07/schema#", "title": f"{kind} {served['name']}", **schema}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd", type=Path)
    parser.add_argument("--version", help="the CRD version (default: its storage version)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # 2 MB of YAML: the C loader when built
    (crd,) = [doc for doc in yaml.load_all(args.crd.read_text(), Loader=loader) if doc]
    args.out.write_text(json.dumps(crd_json_schema(crd, args.version)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
