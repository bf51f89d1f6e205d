#!/usr/bin/env bash
# Regenerate router/tandem_pb2.py and router/tandem_pb2_grpc.py from router/tandem.proto.
# Needs grpcio-tools (pip install -e ".[test]"). The generated modules are committed: run this
# after editing the proto and commit the three files together.
#
# protoc is run on the proto placed at tandem/router/tandem.proto, its import path, so that
# the generated code imports `from tandem.router import tandem_pb2` and the message classes'
# __module__ is `tandem.router.tandem_pb2`: Serve's gRPC proxy pickles request messages to
# send them to a replica, and pickle finds a class by its module.
#
# The generated code checks its runtime: tandem_pb2 needs protobuf >= the version of the
# protoc inside grpcio-tools, and tandem_pb2_grpc needs grpcio >= grpcio-tools' version, so
# the lower bounds in pyproject.toml follow the grpcio-tools used here.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/tandem/router"
cp "$here/tandem.proto" "$work/tandem/router/tandem.proto"
python3 -m grpc_tools.protoc -I"$work" --python_out="$work" --grpc_python_out="$work" tandem/router/tandem.proto
cp "$work/tandem/router/tandem_pb2.py" "$work/tandem/router/tandem_pb2_grpc.py" "$here/"
grep -q '^from tandem.router import tandem_pb2 as ' "$here/tandem_pb2_grpc.py"
