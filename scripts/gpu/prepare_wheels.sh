#!/usr/bin/env bash
# Packages a bare GPU machine (Python 3.12, torch 2.11.0+cu130, no package index) needs for the
# GPU runtime, packed in chunks of at most 62 MB under .whl/ (git-excluded), one per device call.
#
#   scripts/gpu/prepare_wheels.sh            # here, on a machine that reaches PyPI
#
# What goes in: vllm 0.24.0 (its torch pin is the GPU machine's torch), torchmonarch 0.7.0,
# torchtitan 0.3.0, pygtrie and everything they need that the GPU image lacks, resolved by
# ../shared/tools/device-wheels; torchstore 0.1.2 separately under .whl/ts/ because its metadata
# pins torch 2.9.0 and torchmonarch 0.1.2 (it is installed with --no-deps, as on CPU; see
# runtime/compat/torchstore.py). The project itself needs no wheel: every device call runs in a
# copy of this checkout, so `PYTHONPATH=$PWD` makes recipes/, launcher/ and runtime/ importable
# (Monarch procs and vLLM workers inherit it).
#
# Device calls, back to back: a machine stays warm only ~30 s after a call, and what was
# installed or assembled in /tmp goes with it. Each command is under 2,000 characters.
#   1. for each chunk cNN but the last:      carry [".whl/cNN"]
#        mkdir -p /tmp/asm && cp .whl/cNN/* /tmp/asm/
#   2. the last chunk, assembling and installing, then the GPU tests:
#        carry [".whl/cLAST", ".whl/ts"]       command: scripts/gpu/device_run.sh tests
#   3. the GRPO benchmark and the standalone vLLM throughput (each under the 600 s limit):
#        command: scripts/gpu/device_run.sh bench
# scripts/gpu/device_run.sh installs first whenever /tmp/asm holds unassembled chunks, so
# step 2 and 3 work in either order; see scripts/gpu/README.md.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
tools="$top/../shared/tools"
"$tools/device-wheels" vllm==0.24.0 torchmonarch==0.7.0 torchtitan==0.3.0 pygtrie
rm -rf .whl/ts
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  -d .whl/ts torchstore==0.1.2
echo "chunks:"
du -sh .whl/c* .whl/ts
