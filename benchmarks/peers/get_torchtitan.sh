#!/usr/bin/env bash
# Lays out .peers/ (gitignored) for benchmarks/peers/torchtitan.py, on the CPU machine (the GPU machine has no network):
#   .peers/torchtitan/   torchtitan's `torchtitan` package at the pinned commit (+ COMMIT, the hash)
#   .peers/site/         the pure-Python packages its model path imports that the GPU image lacks, unzipped from wheels
# torchtitan comes from a local bare mirror of github.com/pytorch/torchtitan (the search tool's fetch of
# "github:pytorch/torchtitan" puts one at the default path; or set TORCHTITAN_GIT). Then carry ".peers" to the GPU:
#   PYTHONPATH=.:.peers/torchtitan:.peers/site python benchmarks/peers/torchtitan.py ...
# Usage: bash benchmarks/peers/get_torchtitan.sh   (again: replaces .peers/)
set -euo pipefail
COMMIT=43e52fd017ce8689cb0b34c62a35daac9910c6c1   # torchtitan main, 2026-06-08: the newest that runs on torch 2.11
GIT_DIR=${TORCHTITAN_GIT:-/work/.mirror/pytorch+torchtitan/repo}
# pinned versions: what the package index served on 2026-12-02; spmd_types as torchtitan's pyproject pins it
PACKAGES=(tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 typing_extensions==4.16.0 spmd_types==0.2.1)
PYTHON=${PYTHON:-python3}

cd "$(dirname "$0")/../.."
if ! git --git-dir="$GIT_DIR" cat-file -e "$COMMIT^{commit}" 2>/dev/null; then
    echo "get_torchtitan.sh: no torchtitan commit $COMMIT in $GIT_DIR; fetch a mirror of pytorch/torchtitan" \
         "(the search tool's fetch, source github:pytorch/torchtitan) or set TORCHTITAN_GIT to a clone" >&2
    exit 2
fi
rm -rf .peers
mkdir -p .peers/torchtitan .peers/site .peers/wheels
# only the package (tests/ and assets/ hold blobs a partial mirror may lack)
git --git-dir="$GIT_DIR" archive "$COMMIT" torchtitan 2>/dev/null | tar -x -C .peers/torchtitan
find .peers/torchtitan -type l -delete   # links (into .ci/, not extracted; an AGENTS.md): none is code
echo "$COMMIT" > .peers/torchtitan/COMMIT
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d .peers/wheels "${PACKAGES[@]}"
for wheel in .peers/wheels/*.whl; do
    "$PYTHON" -m zipfile -e "$wheel" .peers/site
done
rm -rf .peers/wheels
test -f .peers/torchtitan/torchtitan/models/qwen3/model.py
du -sh .peers
