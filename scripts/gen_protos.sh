#!/usr/bin/env bash
# Regenerate meshgate/v1/*_pb2*.py from proto/. Usage: gen_protos.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
mkdir -p "$out"
"${PYTHON:-python}" -m grpc_tools.protoc -I proto \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/meshgate/v1/*.proto
