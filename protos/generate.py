"""Regenerate the Python stubs in common/pb/ from the .proto files in protos/.

Run: ``python protos/generate.py`` (needs grpcio-tools, the ``dev`` extra). The output is committed;
``tests/e2e/test_protos.py`` fails when it is stale.

Two rewrites make the stubs importable from the ``common.pb`` package and safe to load beside
``tritonclient`` in one process:
- protoc's absolute imports (``from inference import ...``) become ``from common.pb.inference ...``;
- the stubs register their descriptors in a private pool (``common.pb._pool.POOL``), not protobuf's
  default pool, where tritonclient registers its own ``inference.*`` messages under other file names
  (two registrations of one symbol in one pool are an error).
"""

from __future__ import annotations

import pathlib
import re
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "common" / "pb"
PROTOS = ["inference/model_config.proto", "inference/grpc_service.proto", "nexus/control.proto"]
PACKAGES = ["inference", "nexus"]


def _rewrite(text: str) -> str:
    for pkg in PACKAGES:
        text = re.sub(rf"^from {pkg} import ", f"from common.pb.{pkg} import ", text, flags=re.M)
    text = text.replace("from google.protobuf import descriptor_pool as _descriptor_pool\n",
                        "from common.pb._pool import POOL as _POOL\n")
    text = text.replace("_descriptor_pool.Default()", "_POOL")
    return text


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Write fresh stubs under ``out_dir`` and return the files written."""
    from grpc_tools import protoc  # imported here: only needed to regenerate

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                *[str(PROTO_DIR / p) for p in PROTOS]]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        written = []
        for src in sorted(pathlib.Path(tmp).rglob("*.py")):
            dest = out_dir / src.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(_rewrite(src.read_text()))
            written.append(dest)
        for pkg in PACKAGES:
            (out_dir / pkg / "__init__.py").write_text("")
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    target = pathlib.Path(argv[argv.index("--out") + 1]).resolve() if "--out" in argv else OUT_DIR
    for pkg in PACKAGES:
        shutil.rmtree(target / pkg, ignore_errors=True)
    files = generate(target)
    print(f"wrote {len(files)} files under {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
