#!/usr/bin/env bash
# Builds .whl/: the wheels bench/accelerator.py needs on an accelerator machine whose image has
# jax (with its GPU / TPU plugin), flax, optax, orbax-checkpoint, chex, numpy, pyarrow, pyyaml,
# matplotlib, torch, transformers, tokenizers, pytest and pytest-xdist, but not rljax's other
# dependencies, and no package registry. Python 3.12, x86-64 manylinux; --no-deps: exactly these.
# Versions: the ones rljax is tested with here. Usage: bash bench/accelerator_wheels.sh [DIR]
set -euo pipefail
dir=${1:-.whl}
py=${PYTHON:-python3}
mkdir -p "$dir"
binary=(
  google-jetstream==0.2.2         # JetStream's Engine API (rljax.rollout)
  tensorflow-datasets==4.9.10     # rljax.data (TFDS builders; TensorFlow itself is not needed)
  array_record==0.8.6             # cp312 manylinux: TFDS's record format
  dm-tree==0.1.10                 # cp312 manylinux
  immutabledict==4.3.1
  simple_parsing==0.1.9
  docstring-parser==0.18.0
  tensorflow-metadata==1.21.0
  googleapis-common-protos==1.76.0
  termcolor==3.3.0
  toml==0.10.2
  importlib_resources==7.1.0
  tensorboardX==2.6.5             # trainer.logger=[tensorboard] and run outputs
)
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${binary[@]}"
# promise (TFDS) is published as a source archive only: pure Python, built into a wheel here.
"$py" -m pip wheel --quiet --no-deps -w "$dir" promise==2.3
ls -1 "$dir"
du -sh "$dir"
