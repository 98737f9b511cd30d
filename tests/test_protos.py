"""The committed generated code of the wire contract matches the .proto files."""

from __future__ import annotations

from pathlib import Path

from rankscope.protos.generate import PROTO_DIR, generate


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh = {p.name: p.read_text() for p in generate(tmp_path)}
    committed = {p.name: p.read_text() for p in PROTO_DIR.iterdir() if p.name in fresh}
    assert set(committed) == set(fresh), "generated files missing: run `make protos`"
    stale = [name for name in fresh if committed[name] != fresh[name]]
    assert not stale, f"{stale} are stale: run `make protos` and commit the result"
