#!/usr/bin/env bash
# Wheels verl needs on the bare GPU machine, for verl as the third peer (bench/verl_grpo.py,
# `scripts/gpu/device_run.sh verl` and `PAIRS_PEER=verl ... pairs`), under .whl/verl0,
# .whl/verl1, ... (git-ignored).
#
#   scripts/gpu/prepare_wheels.sh        # first: it empties .whl/ and writes .whl/c00 ... .whl/ts
#   scripts/gpu/prepare_verl_wheels.sh   # then this, here, on a machine that reaches PyPI
#
# verl (default 0.9.1, VERL_VERSION=... to change) cannot live in the stack's environment: its
# core allows transformers >=5.5.3,<5.11 (its vllm extra pins 5.9.0 with vllm 0.24.0 and torch
# 2.11.0) and the image has 5.17.0. On the machine its wheels go into an environment of their own
# layered over the image's (device_run.sh `install_verl`: a venv whose own packages come first and
# whose .pth adds the image's site-packages after them, so torch, vllm from the chunks and the rest
# are the ones the stack runs). This resolves verl, transformers 5.9.0, ray[default] and
# TransferQueue (verl's default v1 trainer imports it at start; verl lists it in its verl-core
# extra only) for CPython 3.12 / manylinux x86_64 with every package the machine will have as a
# constraint (the image, ../shared/device/python-packages.txt, plus the wheels in .whl/cNN)
# except the ones verl needs at another version (LAYERED: transformers and the tokenizers it
# allows; packaging, which TransferQueue's tensordict 0.10 wants below 26 through pyvers), and
# fsspec as an override (datasets 4.7.0 from the chunks caps it at 2026.2.0, the image has
# 2026.7.0, and that pair already runs there). A conflict with anything else fails the
# resolution here rather than on the machine. What it adds beyond the machine's packages is
# downloaded (never torch or CUDA packages), packed in one tar and split into parts of 46 MiB
# (ray's wheel alone is 70 MiB), as the stack's chunks are: a device call carries one beside the
# checkout (64 MiB in all, the checkout near 14 MiB). On 2026-11-29 that was ray 2.59.0 (the
# newest whose [default] extra takes the image's aiohttp), tensordict 0.10.0, TransferQueue
# 0.1.11, transformers 5.9.0, tokenizers 0.22.2, packaging 25.0, hydra-core 1.3.8 with omegaconf
# 2.3.1 and antlr4-python3-runtime 4.9.3 (a source archive only: built into a wheel here), ray's
# dashboard packages and verl itself: 30 wheels, 98.8 MiB in .whl/verl0, .whl/verl1 (46 MiB each)
# and .whl/verl2, three device calls (a 50 MiB part beside the 14 MiB checkout is over a call's
# 64 MiB). The stack's vLLM 0.24.0 asks transformers >= 5.5.3 and tokenizers
# >= 0.21.1 of the layer: 5.9.0 and 0.22.2 satisfy it.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
verl=${VERL_VERSION:-0.9.1}
layered="transformers tokenizers packaging"
limit=46M
. "$top/scripts/gpu/wheels_common.sh"  # checks, $work, $work/chunks.txt
{ grep '==' "$image"; cat "$work/chunks.txt"; } >"$work/machine.txt"
python3 - "$work/machine.txt" "$layered" >"$work/have.txt" <<'EOF'
import re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n.lower())
layered = {norm(n) for n in sys.argv[2].split()}
for line in open(sys.argv[1]):
    if "==" in line and norm(line.split("==")[0]) not in layered:
        print(line.strip())
EOF
grep -i '^fsspec==' "$work/have.txt" >"$work/override.txt" || true
printf 'verl==%s\ntransformers==5.9.0\nray[default]\nTransferQueue>=0.1.10\n' "$verl" >"$work/req.in"
uv pip compile -q "$work/req.in" --constraint "$work/have.txt" --override "$work/override.txt" \
  --python-version 3.12 --python-platform x86_64-manylinux_2_28 -o "$work/req.txt"
missing "$work/have.txt" "$work/req.txt" >"$work/missing.txt"
echo "beyond the image and the chunks: $(tr '\n' ' ' <"$work/missing.txt")"

mkdir -p "$work/verl-wheels"
# One package at a time: a pure-Python one published as a source archive only
# (antlr4-python3-runtime 4.9.3, hydra-core's pin) is built into a wheel here instead.
while read -r spec; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d "$work/verl-wheels" "$spec" >/dev/null 2>&1 ||
    python3 -m pip wheel -q --no-deps --no-binary=:all: -w "$work/verl-wheels" "$spec" 2>&1 |
    grep -v 'is ignored' || true
done <"$work/missing.txt"
if find "$work/verl-wheels" -name '*.whl' ! -name '*-none-any.whl' ! -name '*manylinux*' |
  grep .; then
  echo "a wheel above is built for this machine only, not the GPU machine's platform" >&2
  exit 1
fi
n=$(find "$work/verl-wheels" -name '*.whl' | wc -l)
want=$(wc -l <"$work/missing.txt")
[ "$n" -eq "$want" ] || { echo "expected $want wheels, got $n" >&2; exit 1; }

# One tar, split: the machine needs every part before it installs (device_run.sh install_verl).
rm -rf .whl/verl[0-9]* .whl/verl
tar cf "$work/verl.tar" -C "$work" verl-wheels
split -b "$limit" -d -a 2 "$work/verl.tar" "$work/part_"
i=0
for part in "$work"/part_*; do
  mkdir -p ".whl/verl$i" && mv "$part" ".whl/verl$i/"
  i=$((i + 1))
done
echo "verl: $n wheels, $(du -b "$work/verl.tar" | awk '{printf "%.1f MiB", $1 / 1048576}') in $i parts (carry each in one device call; see scripts/gpu/README.md):"
for d in .whl/verl[0-9]*; do
  echo "  $d  $(du -b "$d"/part_* | awk '{printf "%.1f MiB", $1 / 1048576}')"
done
