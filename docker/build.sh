#!/usr/bin/env bash
# Builds what docker/compose.yaml runs, without an image registry or a package index in the build:
#   base        locomesh-base:bookworm, a debootstrapped Debian 12 with Python 3.11 (root, once)
#   wheelhouse  docker/wheelhouse/: locomesh and every dependency as wheels (CPU torch)
#   images      locomesh:latest and locomesh-prometheus:latest
# Usage: docker/build.sh [base] [wheelhouse] [images]   (no argument: all three; each is cached)
#
# Environment: LOCOMESH_BASE (default locomesh-base:bookworm; another name, e.g.
# python:3.11-slim-bookworm, is pulled instead of debootstrapped), PYTHON (a Python 3.11 with pip,
# default .venv/bin/python), LOCOMESH_SRC_REF (build locomesh from this git commit instead of the
# working tree), LOCOMESH_DOCKER_CACHE (scratch space, default /var/tmp/locomesh-docker).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
BASE=${LOCOMESH_BASE:-locomesh-base:bookworm}
CACHE=${LOCOMESH_DOCKER_CACHE:-/var/tmp/locomesh-docker}
PYTHON=${PYTHON:-$root/.venv/bin/python}
WHEELHOUSE=$here/wheelhouse
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(base wheelhouse images)
mkdir -p "$CACHE"

say() { printf '[build %s] %s\n' "$(date +%T)" "$*"; }
is_local_base() { [[ $BASE == locomesh-base:* ]]; }

build_base() {
    if docker image inspect "$BASE" >/dev/null 2>&1; then
        say "base $BASE: cached"
        return
    fi
    if ! is_local_base; then
        say "base $BASE: pulling"
        docker pull "$BASE"
        return
    fi
    command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }
    local rootfs=$CACHE/rootfs
    say "base $BASE: debootstrap bookworm into $rootfs"
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$rootfs" >"$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import -c 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
    rm -rf "$rootfs"
    say "base $BASE: imported"
}

build_wheelhouse() {
    # locomesh is built from a clean copy of its sources: the working tree (tracked and untracked,
    # not ignored files) or LOCOMESH_SRC_REF
    local src
    src=$(mktemp -d)
    if [ -n "${LOCOMESH_SRC_REF:-}" ]; then
        git -C "$root" archive "$LOCOMESH_SRC_REF" | tar -x -C "$src"
        say "wheelhouse: locomesh from commit $(git -C "$root" rev-parse --short "$LOCOMESH_SRC_REF")"
    else
        (cd "$root" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar -c) | tar -x -C "$src"
        say "wheelhouse: locomesh from the working tree"
    fi
    mkdir -p "$WHEELHOUSE" "$CACHE/previous"
    rm -f "$CACHE"/previous/*.whl
    mv "$WHEELHOUSE"/locomesh-*.whl "$CACHE/previous/" 2>/dev/null || true
    # wheels already in the wheelhouse are reused; torch is pinned in constraints.txt
    "$PYTHON" -m pip wheel --quiet --disable-pip-version-check -w "$WHEELHOUSE" --find-links "$WHEELHOUSE" \
        -c "$src/constraints.txt" "$src" >"$CACHE/wheelhouse.log" 2>&1 || { tail -20 "$CACHE/wheelhouse.log" >&2; exit 1; }
    cp "$src/constraints.txt" "$WHEELHOUSE/constraints.txt"
    # an unchanged locomesh keeps its previous wheel file, so Docker's layer cache still holds
    if "$PYTHON" - "$WHEELHOUSE" "$CACHE/previous" <<'EOF'
import pathlib, sys, zipfile
def content(d):
    return [sorted((i.filename, i.CRC) for i in zipfile.ZipFile(w).infolist()) for w in sorted(pathlib.Path(d).glob("locomesh-*.whl"))]
sys.exit(content(sys.argv[1]) != content(sys.argv[2]))
EOF
    then
        mv -f "$CACHE"/previous/locomesh-*.whl "$WHEELHOUSE"/
    fi
    rm -rf "$src"
    say "wheelhouse: $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1) in $WHEELHOUSE"
}

build_images() {
    ls "$WHEELHOUSE"/locomesh-*.whl >/dev/null 2>&1 || { echo "no wheelhouse: run docker/build.sh wheelhouse" >&2; exit 1; }
    say "image locomesh:latest (FROM $BASE)"
    docker build --quiet --build-arg BASE="$BASE" -t locomesh:latest "$here" >"$CACHE/image.log" 2>&1 \
        || { tail -30 "$CACHE/image.log" >&2; exit 1; }
    # Prometheus: Debian's package; on the debootstrapped base (no package index inside a build)
    # the .deb is fetched here and unpacked in the image
    local ctx=$CACHE/prometheus-context
    rm -rf "$ctx" && mkdir -p "$ctx"
    cp "$here"/prometheus/Dockerfile "$here"/prometheus/prometheus.yml "$ctx"/
    if is_local_base; then
        mkdir -p "$CACHE/debs"
        ls "$CACHE"/debs/prometheus_*.deb >/dev/null 2>&1 || (cd "$CACHE/debs" && apt-get -q -o APT::Sandbox::User=root download prometheus >/dev/null)
        cp "$CACHE"/debs/prometheus_*.deb "$ctx"/
    fi
    say "image locomesh-prometheus:latest (FROM $BASE)"
    docker build --quiet --build-arg BASE="$BASE" -t locomesh-prometheus:latest "$ctx" >"$CACHE/prometheus-image.log" 2>&1 \
        || { tail -30 "$CACHE/prometheus-image.log" >&2; exit 1; }
    rm -rf "$ctx"
}

for step in "${steps[@]}"; do
    case $step in
        base) build_base ;;
        wheelhouse) build_wheelhouse ;;
        images) build_images ;;
        *) echo "unknown step $step (base, wheelhouse, images)" >&2; exit 2 ;;
    esac
done
