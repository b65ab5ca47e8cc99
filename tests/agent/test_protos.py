"""The committed stubs in extproc/_proto/ match proto/ (regenerated into a temp dir)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen_protos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_current(gen_protos: ModuleType) -> None:
    problems = gen_protos.stale_files()
    assert not problems, "stubs are stale; run `make stubs`:\n" + "\n".join(problems)


def test_a_stale_stub_is_detected(gen_protos: ModuleType, tmp_path: Path) -> None:
    stale = tmp_path / "_proto"
    shutil.copytree(gen_protos.STUB_ROOT, stale, ignore=shutil.ignore_patterns("__pycache__"))
    grpc_stub = stale / "llm_extproc" / "v1" / "node_load_pb2_grpc.py"
    grpc_stub.write_text(grpc_stub.read_text().replace("extproc._proto.llm_extproc", "llm_extproc"))
    (stale / "llm_extproc" / "v1" / "node_load_pb2.pyi").unlink()
    problems = gen_protos.stale_files(stale)
    assert len(problems) == 2
    assert any(p.startswith("missing: ") and p.endswith("node_load_pb2.pyi") for p in problems)
    assert any("+from extproc._proto.llm_extproc.v1 import node_load_pb2" in p for p in problems)


def test_generator_version_lines_alone_are_not_staleness(gen_protos: ModuleType, tmp_path: Path) -> None:
    copy = tmp_path / "_proto"
    shutil.copytree(gen_protos.STUB_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    grpc_stub = copy / "llm_extproc" / "v1" / "node_load_pb2_grpc.py"
    text = grpc_stub.read_text()
    assert "GRPC_GENERATED_VERSION = '" in text
    lines = ["GRPC_GENERATED_VERSION = '0.0.1'" if ln.startswith("GRPC_GENERATED_VERSION") else ln for ln in text.splitlines()]
    grpc_stub.write_text("\n".join(lines) + "\n")
    assert gen_protos.stale_files(copy) == []


def test_stubs_import_as_a_subpackage() -> None:
    from extproc._proto.llm_extproc.v1 import node_load_pb2, node_load_pb2_grpc

    assert node_load_pb2.DESCRIPTOR.package == "llm_extproc.v1"
    assert node_load_pb2_grpc.NodeLoadStub.__module__ == "extproc._proto.llm_extproc.v1.node_load_pb2_grpc"
