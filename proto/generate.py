"""Regenerate (or check) the Python for ``proto/orchard/v1/orchard.proto`` with grpc_tools.

    python -m proto.generate          # rewrite orchard_pb2.py, orchard_pb2.pyi, orchard_pb2_grpc.py
    python -m proto.generate --check  # exit 1 and name the stale files if they differ

protoc runs with the repository root as include path, so the generated service module imports
``proto.orchard.v1.orchard_pb2`` (the importable path), not a bare ``orchard.v1``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ("proto/orchard/v1/orchard.proto",)
OUTPUT_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generated_paths() -> list[str]:
    """Repository-relative paths of every generated file."""
    return [p.removesuffix(".proto") + s for p in PROTO_FILES for s in OUTPUT_SUFFIXES]


def run_protoc(out_dir: Path) -> None:
    well_known = str(resources.files("grpc_tools") / "_proto")
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
            *(str(ROOT / p) for p in PROTO_FILES)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(PROTO_FILES)}")


def stale_files() -> list[str]:
    """Generated files whose committed text differs from a fresh protoc run."""
    with tempfile.TemporaryDirectory() as tmp:
        run_protoc(Path(tmp))
        return [rel for rel in generated_paths()
                if not (ROOT / rel).exists()
                or (Path(tmp) / rel).read_text() != (ROOT / rel).read_text()]


def regenerate() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        run_protoc(Path(tmp))
        for rel in generated_paths():
            (ROOT / rel).write_text((Path(tmp) / rel).read_text())
    return generated_paths()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for rel in stale:
            print(f"stale: {rel} (run `python -m proto.generate`)", file=sys.stderr)
        return 1 if stale else 0
    for rel in regenerate():
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
