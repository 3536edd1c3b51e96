"""The wheel installs one import name, treespec, and everything the repository's packages
hold: their modules, the committed stubs and .proto, and the shipped checkpoints."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("common", "kernels", "draft_service", "verify_service", "protos")


def test_the_wheel_holds_treespec_alone_and_every_module(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    [wheel] = tmp_path.glob("treespec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"treespec"}
    expected = {f"treespec/{p.relative_to(ROOT)}" for folder in FOLDERS
                for p in (ROOT / folder).rglob("*")
                if p.suffix in (".py", ".proto", ".safetensors") and "__pycache__" not in p.parts}
    assert expected - set(names) == set()
