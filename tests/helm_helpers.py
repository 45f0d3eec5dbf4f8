"""The Helm chart (deploy/helm/tandem) rendered offline by Helm v4 (helm-python-sdk), as
`helm install tandem <chart> -n default -f <values>` would: its value sets, its manifests
parsed, and the pieces the tests look up in them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import yaml

HELM = Path(__file__).resolve().parent.parent / "deploy" / "helm"
CHART = HELM / "tandem"
EXAMPLES = ("cpu-small", "gpu-1p1d", "gpu-2p4d-keda")
VALUE_SETS = ("default", *EXAMPLES)  # "default": the chart's own values.yaml
RELEASE, NAMESPACE = "tandem", "default"
NOTES = "tandem/templates/NOTES.txt"


@dataclass(frozen=True)
class Manifest:
    source: str  # the template it came from, e.g. tandem/templates/redis.yaml
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.doc["kind"]

    @property
    def name(self) -> str:
        return self.doc["metadata"]["name"]


def values(value_set: str) -> dict[str, Any]:
    if value_set == "default":
        return {}
    return yaml.safe_load((HELM / "examples" / f"{value_set}.yaml").read_text())


def render(vals: dict[str, Any]) -> dict[str, str]:
    """Template path -> rendered text, NOTES.txt included."""
    with helm_python.Chart.load(CHART) as chart:
        return chart.render(vals, name=RELEASE, namespace=NAMESPACE, is_install=True)


def manifests(rendered: dict[str, str]) -> list[Manifest]:
    """Every non-empty YAML document of every template but NOTES.txt, by template path."""
    return [Manifest(path, doc) for path in sorted(rendered) if path != NOTES
            for doc in yaml.safe_load_all(rendered[path]) if doc]


def find(docs: list[Manifest], kind: str, name: str) -> dict[str, Any]:
    [doc] = [m.doc for m in docs if m.kind == kind and m.name == name]
    return doc


def container(docs: list[Manifest], kind: str, name: str) -> dict[str, Any]:
    """The one container of a workload's pod template."""
    [c] = find(docs, kind, name)["spec"]["template"]["spec"]["containers"]
    return c


def flag_values(args: list[str], flag: str) -> list[str]:
    """Every value given to `flag` in an argument list (as `--flag value`)."""
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
