"""Generate the Python code of the wire contract: ``python -m rankscope.protos.generate [OUT_DIR]``.

protoc names modules after the .proto paths (``rankscope.v1.telemetry_pb2``); rankscope installs
them as ``rankscope.protos.rankscope.v1``, so the generated imports are rewritten to that
package. Without OUT_DIR the files are written next to the .proto files (``make protos``); the
staleness test writes them elsewhere and compares.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PROTO_DIR = ROOT / "rankscope" / "v1"
PACKAGE = "rankscope.protos.rankscope.v1"


def generate(out_dir: Path) -> list[Path]:
    """Write every ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` into ``out_dir``; returns the files."""
    from grpc_tools import protoc  # a build-time dependency (the dev extra)

    protos = sorted(PROTO_DIR.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        if protoc.main([*args, *(str(p) for p in protos)]) != 0:
            raise RuntimeError("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted((Path(tmp) / "rankscope" / "v1").iterdir()):
            text = re.sub(r"^from rankscope\.v1 import", f"from {PACKAGE} import", src.read_text(), flags=re.M)
            (out_dir / src.name).write_text(text)
            written.append(out_dir / src.name)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR):
        print(path)
