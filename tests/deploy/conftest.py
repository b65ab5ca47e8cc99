"""Shared paths and loaders for the deployment artefacts under deploy/."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def load_all(path: Path) -> list[dict]:
    """Every YAML document of a file (empty documents dropped)."""
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def k8s_objects(kind: str | None = None) -> list[dict]:
    """The base manifests' objects (optionally of one kind)."""
    objs = [d for p in sorted((DEPLOY / "k8s/base").glob("*.yaml")) if p.name != "kustomization.yaml" for d in load_all(p)]
    return [o for o in objs if kind is None or o["kind"] == kind]


def k8s_object(kind: str, name: str) -> dict:
    (found,) = [o for o in k8s_objects(kind) if o["metadata"]["name"] == name]
    return found
