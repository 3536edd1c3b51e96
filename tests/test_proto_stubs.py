"""The committed gRPC stubs are exactly what the pinned grpcio-tools makes of the .proto.

Stubs from a newer grpcio-tools refuse to import on the benchmark image (grpcio
1.84.0, protobuf 7.36.2): even 1.84.2's stubs demand grpcio>=1.84.2. So the pin,
the installed generator, the versions baked into the stubs and the output are checked.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "protos/treespec/v1/treespec.proto"
STUBS = ("treespec_pb2.py", "treespec_pb2.pyi", "treespec_pb2_grpc.py")
# The benchmark image's grpcio. Generated *_grpc.py refuses to import on a grpcio
# older than the grpcio-tools that made it, so the tools are pinned to exactly this.
TARGET_GRPCIO = (1, 84, 0)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:3])


def _pinned_tools() -> str:
    m = re.search(r'"grpcio-tools==([0-9.*]+)"', (ROOT / "pyproject.toml").read_text())
    assert m, "pyproject's test extra must pin grpcio-tools with =="
    return m.group(1)


def test_pyproject_pins_grpcio_tools_to_the_target_grpcio():
    assert _pinned_tools() == ".".join(map(str, TARGET_GRPCIO))


def test_installed_grpcio_tools_is_the_pinned_one():
    version = importlib.metadata.version("grpcio-tools")
    assert version.startswith("1.84."), f"grpcio-tools {version}: the stubs need the 1.84 series"
    assert version == _pinned_tools(), (
        f"grpcio-tools {version} is installed but pyproject pins {_pinned_tools()}: "
        "run pip install -e '.[test]'")


def generate(out: Path) -> Path:
    """Run the pinned protoc on the .proto as the installed package sees it, so the stubs
    import each other as ``treespec.protos.treespec.v1``; returns the folder of the stubs.

    The repository keeps protos/ at its top level and installs it as treespec.protos, so
    protoc reads it through a ``treespec/protos`` link in a scratch include root."""
    root = out / "include"
    (root / "treespec").mkdir(parents=True)
    (root / "treespec" / "protos").symlink_to(ROOT / "protos")
    proc = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(root), f"--python_out={out}",
         f"--grpc_python_out={out}", f"--pyi_out={out}", str(root / "treespec" / PROTO)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out / "treespec" / "protos/treespec/v1"


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    fresh_dir = generate(tmp_path)
    drift = []
    for name in STUBS:
        committed = (ROOT / "protos/treespec/v1" / name).read_text().splitlines(keepends=True)
        fresh = (fresh_dir / name).read_text().splitlines(keepends=True)
        if committed != fresh:
            drift.append("".join(difflib.unified_diff(committed, fresh, f"committed/{name}",
                                                      f"regenerated/{name}", n=1))[:3000])
    assert not drift, ("stubs drifted from the .proto; regenerate them from the repo root with\n"
                       "  python tests/test_proto_stubs.py\n\n" + "\n".join(drift))


def test_stubs_accept_the_target_runtime():
    """The version checks baked into the stubs pass on grpcio 1.84.0 / protobuf 7.36.2."""
    grpc_stub = (ROOT / "protos/treespec/v1/treespec_pb2_grpc.py").read_text()
    m = re.search(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_stub, re.M)
    assert m and _version(m.group(1)) <= TARGET_GRPCIO, (
        f"treespec_pb2_grpc.py needs grpcio>={m and m.group(1)}, the benchmark image has "
        f"{'.'.join(map(str, TARGET_GRPCIO))}")
    pb2 = (ROOT / "protos/treespec/v1/treespec_pb2.py").read_text()
    m = re.search(r"^# Protobuf Python Version: ([0-9.]+)", pb2, re.M)
    assert m and (7, 0, 0) <= _version(m.group(1)) <= (7, 36, 2), m and m.group(1)


def test_stubs_import_and_declare_both_services():
    from treespec.protos.treespec.v1 import treespec_pb2 as pb
    from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc

    services = pb.DESCRIPTOR.services_by_name
    assert set(services) == {"Generation", "Drafter"}
    assert [m.name for m in services["Drafter"].methods] == ["GetInfo", "Speculate",
                                                        "GetProjection"]
    assert hasattr(pb_grpc, "GenerationStub") and hasattr(pb_grpc, "add_DrafterServicer_to_server")


if __name__ == "__main__":   # regenerate the committed stubs
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        fresh_dir = generate(Path(tmp))
        for name in STUBS:
            shutil.copy(fresh_dir / name, ROOT / "protos/treespec/v1" / name)
