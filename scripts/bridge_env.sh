#!/usr/bin/env bash
# Build .venv-bridge-0.6: NVIDIA Megatron-Bridge 0.6.2 on megatron-core 0.19.2, torch 2.13.0 CPU, in which tests
# run Megatron-Bridge itself (AutoBridge.export_ckpt / import_ckpt, its checkpoint loading) as an independent
# reader and writer of torch_dist checkpoints with run_config.yaml.
#
# Usage: bash scripts/bridge_env.sh. Safe to run again: an environment whose stamp records the same recipe is
# left alone (well under a second); an interrupted build has no stamp and starts over.
#
# Megatron-Bridge declares Python >= 3.12 and a long list of dependencies (flashinfer, transformer-engine,
# wandb, mlflow, ...) that its checkpoint conversion path never imports. It goes in --no-deps and
# --ignore-requires-python, followed by only the packages `import megatron.bridge` and its conversion and
# checkpointing modules import (BRIDGE_DEPS). megatron-core is built from its sdist with the one
# `typing.override` patch of scripts/megatron_envs.sh (pip caches the built wheel). No file of either package is
# patched beyond that: the CPU stand-ins (a transient transformer_engine stub, CUDA calls mapped to the CPU, the
# local layer spec) live in the driver, tests/support/bridge/driver.py. ../shared/MEGATRON-BRIDGE-CPU.md lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=.venv-bridge-0.6
STAMP=.mconvert-env
TORCH="torch==2.13.0"
MCORE="megatron-core==0.19.2"
BRIDGE="megatron-bridge==0.6.2"
COMMON=(numpy packaging pybind11 setuptools wheel psutil triton "transformers==5.12.1")
BRIDGE_DEPS=(omegaconf "hydra-core<1.4" pyyaml einops rich tqdm regex six safetensors accelerate datasets requests
    tensorboard megatron-energon nvidia-modelopt peft)
PATCHES=1  # bump when the build recipe changes in a way the package lists do not show

quiet() {  # pip's warnings about index locations configured on this machine but absent are noise here
    "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

recipe="$BRIDGE $MCORE $TORCH ${COMMON[*]} ${BRIDGE_DEPS[*]} patches=$PATCHES"
if [ -f "$DIR/$STAMP" ] && [ "$(cat "$DIR/$STAMP")" = "$recipe" ]; then
    echo "$DIR: megatron-bridge 0.6.2, up to date"
    exit 0
fi
start=$SECONDS
# The packages installed (the long part) but the check not passed yet: only the check runs again.
if [ -f "$DIR/$STAMP.installed" ] && [ "$(cat "$DIR/$STAMP.installed")" = "$recipe" ]; then
    "$DIR/bin/python" -W ignore tests/support/bridge/driver.py check
    echo "$recipe" > "$DIR/$STAMP"
    echo "$DIR: checked in $((SECONDS - start)) s"
    exit 0
fi
echo "$DIR: building megatron-bridge 0.6.2 on megatron-core 0.19.2"
rm -rf "$DIR"
"$PY" -m venv "$DIR"
pip=(quiet "$DIR/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "$TORCH"
# Every later install names the CPU torch again so that nothing swaps it for a CUDA build.
"${pip[@]}" "${COMMON[@]}" "$TORCH"
PATH="$PWD/$DIR/bin:$PATH" "${pip[@]}" --no-deps --no-build-isolation --ignore-requires-python \
    --no-binary megatron-core "$MCORE"
site=$("$DIR/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for f in "$site"/megatron/training/models/gpt.py "$site"/megatron/training/models/hybrid.py; do
    [ -f "$f" ] && sed -i 's/^from typing import \(.*\), override$/from typing import \1\nfrom typing_extensions import override/' "$f"
done
"${pip[@]}" "${BRIDGE_DEPS[@]}" "$TORCH" "transformers==5.12.1"
"${pip[@]}" --no-deps --ignore-requires-python "$BRIDGE"
echo "$recipe" > "$DIR/$STAMP.installed"
# The import check runs under the driver's CPU stand-ins (a bare `import megatron.bridge` needs Transformer
# Engine); it proves every module the conversion path imports is present.
"$DIR/bin/python" -W ignore tests/support/bridge/driver.py check
echo "$recipe" > "$DIR/$STAMP"
echo "$DIR: built in $((SECONDS - start)) s"
