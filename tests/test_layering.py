"""The layering the design fixes: neither engine loads grpc or the generated stubs;
common/ imports no service; the two services never import each other."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from treespec.common.serving.launch import child_env

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "draft_service", "verify_service")


@pytest.mark.parametrize("engine", ["treespec.verify_service.engine", "treespec.draft_service.engine"])
def test_an_engine_loads_without_grpc_or_the_stubs(engine):
    code = (f"import sys, {engine}; bad = sorted(m for m in sys.modules if m.split('.')[0] "
            "in ('grpc', 'grpc_health', 'grpc_reflection') or m.startswith('treespec.protos'))"
            "; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          env=child_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def imported_packages(path: Path) -> set[str]:
    """The treespec packages a module's import statements name (absolute imports):
    "common" for treespec.common.x, and so on."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[1] for n in names if n.startswith("treespec.")}
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_common_imports_no_service_and_the_services_not_each_other(package):
    forbidden = {"common": {"draft_service", "verify_service"},
                 "draft_service": {"verify_service"},
                 "verify_service": {"draft_service"}}[package]
    bad = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & forbidden)
           for p in (ROOT / package).rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_every_draft_method_has_a_proposer():
    from treespec.draft_service.config import METHODS
    from treespec.draft_service.registry import PROPOSERS

    assert list(PROPOSERS) == list(METHODS)
