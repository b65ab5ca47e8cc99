"""Shared paths and loaders for the deployment artefacts under deploy/."""

from __future__ import annotations

import copy
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


def _merge(into: dict, patch: dict) -> None:
    """A strategic-merge patch as our overlays use it: maps merged key by key, lists of named
    maps (containers, env, volumes: their merge key is `name`) merged by name, anything else
    replaced."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif _named(value) and _named(into.get(key)):
            by_name = {item["name"]: item for item in into[key]}
            for item in value:
                if item["name"] in by_name:
                    _merge(by_name[item["name"]], item)
                else:
                    into[key].append(copy.deepcopy(item))
        else:
            into[key] = copy.deepcopy(value)


def _named(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, dict) and "name" in i for i in value)


def _json6902(obj: dict, ops: list[dict]) -> None:
    for op in ops:
        assert op["op"] in ("add", "replace"), op
        *parents, key = op["path"].strip("/").split("/")
        node = obj
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        assert op["op"] == "add" or key in node, f"replace of a missing {op['path']}"
        node[key] = copy.deepcopy(op["value"])


def render_kustomization(directory: Path) -> list[dict]:
    """What `kubectl kustomize DIRECTORY` builds, for the features our kustomizations use:
    `resources` (files and other kustomization directories, recursively), `images`, and
    `patches` (strategic merge from a file, matched by kind/name; JSON 6902 inline with a
    target). A patch whose target does not exist fails, as kustomize does."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))
    objs: list[dict] = []
    for entry in k.get("resources", []):
        path = directory / entry
        objs += render_kustomization(path) if path.is_dir() else copy.deepcopy(load_all(path))
    for image in k.get("images", []):
        for o in objs:
            for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                name, _, _ = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    for p in k.get("patches", []):
        if "path" in p:
            for patch in load_all(directory / p["path"]):
                (target,) = [o for o in objs if (o["kind"], o["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])]
                _merge(target, patch)
        else:
            t = p["target"]
            (target,) = [o for o in objs if (o["kind"], o["metadata"]["name"]) == (t["kind"], t["name"])]
            _json6902(target, yaml.safe_load(p["patch"]))
    return objs
