#!/usr/bin/env bash
# The wheels the GPU host lacks, into .whl/ (carry it): the shared list plus what this project added since
# (jsonschema and its dependencies: the API imports it; without them gaggle up's API exits at import).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
../shared/gpu-host/wheels.sh jsonschema jsonschema-specifications referencing rpds-py attrs "$@"
