"""Regenerate the gRPC code next to ``grpc_service.proto`` (needs grpcio-tools): ``python -m servopt.serve.proto.generate``.

See this package's docstring for the command it runs and the one edit it makes.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO = Path(__file__).with_name("grpc_service.proto")
SRC = PROTO.parents[3]  # the folder holding the servopt package
RELATIVE = PROTO.relative_to(SRC)
GENERATED = ("grpc_service_pb2.py", "grpc_service_pb2.pyi", "grpc_service_pb2_grpc.py")

_DEFAULT_POOL = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
_OWN_POOL = ("# servopt: a descriptor pool of its own, so that tritonclient's messages of the same names can be imported\n"
             "# in the same process (see servopt/serve/proto/__init__.py).\n"
             "DESCRIPTOR = _descriptor_pool.DescriptorPool().AddSerializedFile(")


def generate(out: Path = SRC) -> list[Path]:
    """Write the generated files under ``out`` (``out/servopt/serve/proto/…``) and return their paths."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{SRC}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", str(PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    folder = out / RELATIVE.parent
    messages = folder / "grpc_service_pb2.py"
    text = messages.read_text()
    if text.count(_DEFAULT_POOL) != 1:
        raise RuntimeError(f"{messages}: expected one registration in the default descriptor pool; protoc's output changed")
    messages.write_text(text.replace(_DEFAULT_POOL, _OWN_POOL))
    return [folder / name for name in GENERATED]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else SRC):
        print(path)
