#!/usr/bin/env bash
# Build the virtual environments in which tests run megatron-core itself, one per release we check against:
#
#   .venv-mcore-0.16   megatron-core 0.16.1 (megatron.core only: its sdist has no megatron.training)
#   .venv-mcore-0.19   megatron-core 0.19.2 with megatron.training (save_checkpoint, load_checkpoint, args)
#
# Usage: bash scripts/megatron_envs.sh [0.16.1] [0.19.2]   (default: both). Safe to run again: an environment
# whose stamp records the same recipe (versions and package lists below) is left alone, so a second run takes
# well under a second; an interrupted build has no stamp and starts over.
#
# megatron-core >= 0.17 declares Python >= 3.12 and ships cp312 wheels only; its sdist builds and runs on 3.11
# once `typing.override` (3.12) is taken from typing_extensions in megatron/training/models/{gpt,hybrid}.py, the
# one patch applied here. Both releases are built from their sdists (0.16.1's setup.py runs `python3 -m
# pybind11`, hence PATH and --no-build-isolation); pip caches the built wheels, so a rebuild skips compiling.
# The CPU build of torch goes in first and every later install is --no-deps or torch-free: a package that
# asks for torch must never pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.mconvert-env
TORCH="torch==2.13.0"
# Imported by megatron-core / megatron.training without being declared (triton, psutil), or needed by the tests
# in the environment (transformers: Megatron's HuggingFaceTokenizer; build tools for the sdist; einops: Megatron-FSDP,
# megatron/core/distributed/fsdp/mcore_fsdp_adapter.py, builds its device mesh with it).
COMMON=(numpy packaging pybind11 setuptools wheel psutil transformers einops)
PATCHES=1  # bump when the build recipe changes in a way the package lists do not show

quiet() {  # pip's warnings about index locations configured on this machine but absent are noise here
    "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

build() {
    local version=$1 short dir
    short=$(echo "$version" | cut -d. -f1,2)
    dir=.venv-mcore-$short
    local recipe="megatron-core==$version $TORCH ${COMMON[*]} patches=$PATCHES"
    if [ -f "$dir/$STAMP" ] && [ "$(cat "$dir/$STAMP")" = "$recipe" ]; then
        echo "$dir: megatron-core $version, up to date"
        return
    fi
    local start=$SECONDS
    echo "$dir: building megatron-core $version"
    rm -rf "$dir"
    "$PY" -m venv "$dir"
    local pip=(quiet "$dir/bin/python" -m pip install -q --disable-pip-version-check)
    "${pip[@]}" "$TORCH"
    local extra=()
    [ "$short" != "0.16" ] && extra=(triton)
    "${pip[@]}" "${COMMON[@]}" "${extra[@]}" "$TORCH"
    PATH="$PWD/$dir/bin:$PATH" "${pip[@]}" --no-deps --no-build-isolation --ignore-requires-python \
        --no-binary megatron-core "megatron-core==$version"
    local site
    site=$("$dir/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    for f in "$site"/megatron/training/models/gpt.py "$site"/megatron/training/models/hybrid.py; do
        [ -f "$f" ] && sed -i 's/^from typing import \(.*\), override$/from typing import \1\nfrom typing_extensions import override/' "$f"
    done
    local check="import megatron.core, megatron.core.dist_checkpointing, megatron.core.models.gpt"
    [ -d "$site/megatron/training" ] && check="$check, megatron.training.checkpointing, megatron.training.arguments"
    "$dir/bin/python" -W ignore -c "$check"
    echo "$recipe" > "$dir/$STAMP"
    echo "$dir: built in $((SECONDS - start)) s"
}

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.16.1 0.19.2)
for v in "${versions[@]}"; do
    build "$v"
done
