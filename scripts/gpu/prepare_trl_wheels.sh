#!/usr/bin/env bash
# Wheels TRL's GRPOTrainer needs on the bare GPU machine on top of our stack, for the TRL
# baseline (bench/trl_grpo.py, `scripts/gpu/device_run.sh trl`), under .whl/trl/ (git-ignored).
#
#   scripts/gpu/prepare_wheels.sh        # first: it empties .whl/ and writes .whl/c00 ... .whl/ts
#   scripts/gpu/prepare_trl_wheels.sh    # then this, here, on a machine that reaches PyPI
#
# It resolves trl (default 1.16.0, the version of the reference measurement; TRL_VERSION=...
# to change) for CPython 3.12 / manylinux x86_64 with every package the GPU machine will have
# pinned to the version it will have: its image (../shared/device/python-packages.txt) plus
# the wheels in .whl/cNN. Pins are overrides, not constraints, because the machine installs
# with --no-deps: what matters is what is there (datasets 4.7.0 from the chunks caps fsspec
# at 2026.2.0, the image has 2026.7.0, and that pair already runs there). What the resolution
# adds beyond those is downloaded, never torch or CUDA packages. Above 60 MiB in all, the
# wheels are spread over .whl/trl0, .whl/trl1, ... of at most 60 MiB each (a device call
# carries at most 64 MiB of extra files), else they stay in .whl/trl. On 2026-11-21 that was
# trl-1.16.0 alone (0.9 MiB): accelerate is in the image; datasets, dill and multiprocess are
# in the chunks (torchtitan needs them); pyarrow, xxhash, fsspec and pandas are in the image.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
image="$top/../shared/device/python-packages.txt"
trl=${TRL_VERSION:-1.16.0}
limit=$((60 * 1024 * 1024))
if ! ls .whl/c[0-9]*/part_* >/dev/null 2>&1; then
  echo "no .whl/cNN chunks: run scripts/gpu/prepare_wheels.sh first (it empties .whl/)" >&2
  exit 2
fi
[ -f "$image" ] || { echo "missing $image (the GPU image's package list)" >&2; exit 2; }
command -v uv >/dev/null || python3 -m pip install -q uv
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# name==version of every wheel in the chunks (one tar split across .whl/cNN).
cat .whl/c[0-9]*/part_* | tar t | python3 -c '
import sys
for line in sys.stdin:
    name = line.strip().rsplit("/", 1)[-1]
    if name.endswith(".whl"):
        dist, version = name.split("-")[:2]
        print(f"{dist}=={version}")
' >"$work/chunks.txt"
{ grep '==' "$image"; cat "$work/chunks.txt"; } >"$work/have.txt"
echo "trl==$trl" >"$work/req.in"
uv pip compile -q "$work/req.in" --override "$work/have.txt" --python-version 3.12 \
  --python-platform x86_64-manylinux_2_28 -o "$work/req.txt"
python3 - "$work/have.txt" "$work/req.txt" >"$work/missing.txt" <<'EOF'
import re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n.lower())
have = {norm(l.split("==")[0]) for l in open(sys.argv[1]) if "==" in l}
for line in open(sys.argv[2]):
    line = line.split("#")[0].strip()
    if "==" not in line:
        continue
    name = norm(line.split("==")[0])
    cuda = name in ("torch", "triton") or name.startswith(("nvidia-", "cuda-"))
    if name not in have and not cuda:
        print(line)
EOF
echo "beyond the image and the chunks: $(tr '\n' ' ' <"$work/missing.txt")"

plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  plat+=(--platform "$p")
done
rm -rf .whl/trl .whl/trl[0-9]*
mkdir -p .whl/trl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .whl/trl -r "$work/missing.txt" 2>&1 | grep -v 'is ignored' || true
n=$(find .whl/trl -name '*.whl' | wc -l)
[ "$n" -eq "$(wc -l <"$work/missing.txt")" ] || { echo "expected $(wc -l <"$work/missing.txt") wheels, got $n" >&2; exit 1; }

total=$(du -cb .whl/trl/*.whl | tail -1 | cut -f1)
if [ "$total" -gt "$limit" ]; then
  # First fit, largest first: whole wheels per chunk, so the machine needs no reassembly.
  python3 - "$limit" .whl/trl/*.whl <<'EOF'
import os, shutil, sys
limit, wheels = int(sys.argv[1]), sorted(sys.argv[2:], key=os.path.getsize, reverse=True)
bins: list[list[str]] = []
sizes: list[int] = []
for w in wheels:
    size = os.path.getsize(w)
    if size > limit:
        sys.exit(f"{w} alone is over {limit} bytes: carry it split (see device-wheels)")
    i = next((i for i, s in enumerate(sizes) if s + size <= limit), len(bins))
    if i == len(bins):
        bins.append([]), sizes.append(0)
    bins[i].append(w)
    sizes[i] += size
for i, chunk in enumerate(bins):
    os.makedirs(f".whl/trl{i}")
    for w in chunk:
        shutil.move(w, f".whl/trl{i}/")
EOF
  rmdir .whl/trl
fi
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
echo "TRL chunks (carry each in one device call; see scripts/gpu/README.md):"
for d in .whl/trl*; do
  echo "  $d  $(du -b "$d"/*.whl | awk '{s += $1} END {printf "%.1f MiB", s / 1048576}')  $(cd "$d" && ls *.whl | tr '\n' ' ')"
done
