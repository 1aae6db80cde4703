#!/usr/bin/env bash
# Packages a bare GPU machine (Python 3.12, torch 2.11.0+cu130, no package index) needs for the
# GPU runtime, in chunks of 46 MiB under .whl/ (git-ignored), one per remote command.
#
#   scripts/gpu/prepare_wheels.sh            # here, on a machine that reaches PyPI
#
# What goes in: vllm 0.24.0 (its torch pin is the GPU machine's torch), torchmonarch 0.7.0,
# torchtitan 0.3.0, pygtrie and everything they need that the GPU image lacks, resolved and
# packed by ../shared/tools/device-wheels (beside the checkout); torchstore 0.1.2 separately
# under .whl/ts/ because its metadata pins torch 2.9.0 and torchmonarch 0.1.2 (it is installed
# with --no-deps, as on CPU; see runtime/compat/torchstore.py). The project itself needs no
# wheel: every remote command runs in a copy of this checkout, so `PYTHONPATH=$PWD` makes
# recipes/, launcher/ and runtime/ importable (Monarch procs and vLLM workers inherit it).
#
# Then, on the GPU machine, one command per chunk and three runs, back to back (its /tmp and
# installs last only while it stays up): see scripts/gpu/README.md and scripts/gpu/device_run.sh.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
tools="$top/../shared/tools"
"$tools/device-wheels" vllm==0.24.0 torchmonarch==0.7.0 torchtitan==0.3.0 pygtrie
# Re-cut into 46 MiB chunks: a call carries one chunk plus the checkout (64 MiB in all), and the
# checkout with its committed results is near 14 MiB (2026-11-30).
cat .whl/c*/part_* >.whl/all.tar
rm -rf .whl/c[0-9]*
split -b 46M -d -a 2 .whl/all.tar .whl/part_
for part in .whl/part_*; do
  mkdir -p ".whl/c${part##*_}" && mv "$part" ".whl/c${part##*_}/"
done
rm .whl/all.tar
rm -rf .whl/ts
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  -d .whl/ts torchstore==0.1.2
# The trainer alone (`device_run.sh train`) needs only TorchTitan and what importing it pulls in
# that the image lacks: whole wheels from the packed tar, one small carry (.whl/tt).
rm -rf .whl/tt && mkdir -p .whl/tt
cat .whl/c*/part_* | tar xf - -C .whl/tt --strip-components=1 --wildcards \
  'wheels/torchtitan-*' 'wheels/tyro-*' 'wheels/docstring_parser-*' 'wheels/typeguard-*' \
  'wheels/spmd_types-*' 'wheels/dill-*' 'wheels/pydantic-*' 'wheels/pydantic_core-*' \
  'wheels/annotated_types-*' 'wheels/typing_inspection-*'
echo "chunks:"
du -sh .whl/c* .whl/ts .whl/tt
