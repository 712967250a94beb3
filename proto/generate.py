"""Regenerate ps_pb2.py and ps_pb2_grpc.py from ps.proto.

Run ``python proto/generate.py`` after editing ps.proto and commit the result;
``tests/proto/test_proto.py`` fails while the committed modules are stale. The proto
folder is mapped to the virtual import path ``psproto`` so the generated stubs
import each other as ``psproto.ps_pb2`` (the folder is installed under that
name; see pyproject.toml).
"""

import pathlib
import shutil
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


def main() -> int:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as out:
        rc = protoc.main(
            [
                "protoc",
                f"--proto_path=psproto={HERE}",
                f"--python_out={out}",
                f"--grpc_python_out={out}",
                "psproto/ps.proto",
            ]
        )
        if rc != 0:
            return rc
        for name in ("ps_pb2.py", "ps_pb2_grpc.py"):
            shutil.copyfile(pathlib.Path(out, "psproto", name), HERE / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
