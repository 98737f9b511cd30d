"""Generate the Python code of the wire contract: ``python -m rankscope.protos.generate [OUT_DIR]``.

The .proto files live in rankscope/protos/v1/ but declare themselves as ``rankscope/v1/*.proto``
(package ``rankscope.v1``: the name on the wire and in the descriptor pool), so protoc runs on
copies laid out under that path, and the generated imports (``from rankscope.v1 import``) are
rewritten to the package they are installed as, ``rankscope.protos.v1``. Without OUT_DIR the files
are written next to the .proto files (``make protos``); the staleness test writes them elsewhere
and compares.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent / "v1"
PROTO_PATH = Path("rankscope") / "v1"  # where the .proto files say they are (their imports, descriptor names)
PACKAGE = "rankscope.protos.v1"


def generate(out_dir: Path) -> list[Path]:
    """Write every ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` into ``out_dir``; returns the files."""
    from grpc_tools import protoc  # a build-time dependency (the dev extra)

    with tempfile.TemporaryDirectory() as src_root, tempfile.TemporaryDirectory() as tmp:
        protos = []
        for proto in sorted(PROTO_DIR.glob("*.proto")):
            staged = Path(src_root, PROTO_PATH, proto.name)
            staged.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(proto, staged)
            protos.append(str(PROTO_PATH / proto.name))
        args = ["protoc", f"-I{src_root}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        if protoc.main([*args, *protos]) != 0:
            raise RuntimeError("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted((Path(tmp) / PROTO_PATH).iterdir()):
            text = re.sub(r"^from rankscope\.v1 import", f"from {PACKAGE} import", src.read_text(), flags=re.M)
            (out_dir / src.name).write_text(text)
            written.append(out_dir / src.name)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR):
        print(path)
