#!/usr/bin/env bash
# Wheels a peer or an optional part needs on the bare GPU machine on top of our stack, under
# .whl/NAME/ (git-ignored), for requirements that the image and the stack's chunks do not cover:
#
#   scripts/gpu/prepare_wheels.sh                          # first: it empties .whl/ and writes .whl/c00 ... .whl/ts
#   scripts/gpu/prepare_extra_wheels.sh trl trl==1.16.0    # TRL, the baseline (bench/trl_grpo.py); prepare_trl_wheels.sh
#   scripts/gpu/prepare_extra_wheels.sh env openenv==0.6.0 mcp==1.30.0
#                                                          # OpenEnv and FastMCP, for the tools runs (`device_run.sh tools`)
#
# It resolves the requirements for CPython 3.12 / manylinux x86_64 with every package the GPU
# machine will have pinned to the version it will have: its image
# (../shared/device/python-packages.txt) plus the wheels in .whl/cNN. Pins are overrides, not
# constraints, because the machine installs with --no-deps: what matters is what is there
# (datasets 4.7.0 from the chunks caps fsspec at 2026.2.0, the image has 2026.7.0, and that pair
# already runs there). What the resolution adds beyond those is downloaded, never torch or CUDA
# packages. Above 60 MiB in all, the wheels are spread over .whl/NAME0, .whl/NAME1, ... of at most
# 60 MiB each (a device call carries at most 64 MiB of extra files), else they stay in .whl/NAME.
# On 2026-11-21 TRL was trl-1.16.0 alone (0.9 MiB): accelerate is in the image; datasets, dill
# and multiprocess are in the chunks (torchtitan needs them); pyarrow, xxhash, fsspec and pandas
# are in the image.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
name=${1:?usage: prepare_extra_wheels.sh NAME REQUIREMENT ...}
shift
[ $# -gt 0 ] || { echo "usage: prepare_extra_wheels.sh NAME REQUIREMENT ..." >&2; exit 2; }
limit=$((60 * 1024 * 1024))
. "$top/scripts/gpu/wheels_common.sh"  # checks, $work, $work/chunks.txt
# A package named on the command line is taken at the version asked for, not the machine's:
# FastMCP 3.4 needs mcp < 2 and the image has mcp 2.3.0, so `env` asks for mcp==1.30.0 and the
# machine installs it over the image's (--no-deps).
asked=$(printf '%s\n' "$@" | sed -E 's/[<>=!~ ;\[].*//' | tr 'A-Z_.' 'a-z--')
{ grep '==' "$image"; cat "$work/chunks.txt"; } | while IFS= read -r pin; do
  n=$(printf '%s' "${pin%%==*}" | tr 'A-Z_.' 'a-z--')
  printf '%s\n' "$asked" | grep -qx "$n" || printf '%s\n' "$pin"
done >"$work/have.txt"
printf '%s\n' "$@" >"$work/req.in"
uv pip compile -q "$work/req.in" --override "$work/have.txt" --python-version 3.12 \
  --python-platform x86_64-manylinux_2_28 -o "$work/req.txt"
missing "$work/have.txt" "$work/req.txt" >"$work/missing.txt"
echo "beyond the image and the chunks: $(tr '\n' ' ' <"$work/missing.txt")"

rm -rf ".whl/$name" ".whl/$name"[0-9]*
mkdir -p ".whl/$name"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d ".whl/$name" -r "$work/missing.txt" 2>&1 | grep -v 'is ignored' || true
n=$(find ".whl/$name" -name '*.whl' | wc -l)
[ "$n" -eq "$(wc -l <"$work/missing.txt")" ] || { echo "expected $(wc -l <"$work/missing.txt") wheels, got $n" >&2; exit 1; }

total=$(du -cb ".whl/$name"/*.whl | tail -1 | cut -f1)
if [ "$total" -gt "$limit" ]; then
  # First fit, largest first: whole wheels per chunk, so the machine needs no reassembly.
  python3 - "$limit" "$name" ".whl/$name"/*.whl <<'EOF'
import os, shutil, sys
limit, name = int(sys.argv[1]), sys.argv[2]
wheels = sorted(sys.argv[3:], key=os.path.getsize, reverse=True)
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
    os.makedirs(f".whl/{name}{i}")
    for w in chunk:
        shutil.move(w, f".whl/{name}{i}/")
EOF
  rmdir ".whl/$name"
fi
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
echo "$name chunks (carry each in one device call; see scripts/gpu/README.md):"
for d in ".whl/$name" ".whl/$name"[0-9]*; do
  [ -d "$d" ] || continue
  echo "  $d  $(du -b "$d"/*.whl | awk '{s += $1} END {printf "%.1f MiB", s / 1048576}')  $(cd "$d" && ls *.whl | tr '\n' ' ')"
done
