# Sourced by prepare_extra_wheels.sh and prepare_verl_wheels.sh, at the checkout's top ($top):
# what both need before they resolve against the GPU machine. It checks that the stack's chunks
# (.whl/cNN) and the image's package list ($image) are there, gets uv, makes a work folder
# ($work, removed on exit) and writes $work/chunks.txt: name==version of every wheel in the
# chunks (one tar split across .whl/cNN); `missing HAVE REQ` prints the pins of REQ (a resolution)
# that HAVE (name==version lines) lacks, extras dropped, never torch, triton or CUDA packages;
# `plat` holds pip's --platform options for the machine (manylinux x86_64, glibc up to 2.34).
image="$top/../shared/device/python-packages.txt"
if ! ls .whl/c[0-9]*/part_* >/dev/null 2>&1; then
  echo "no .whl/cNN chunks: run scripts/gpu/prepare_wheels.sh first (it empties .whl/)" >&2
  exit 2
fi
[ -f "$image" ] || { echo "missing $image (the GPU image's package list)" >&2; exit 2; }
command -v uv >/dev/null || python3 -m pip install -q uv
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat .whl/c[0-9]*/part_* | tar t | python3 -c '
import sys
for line in sys.stdin:
    name = line.strip().rsplit("/", 1)[-1]
    if name.endswith(".whl"):
        dist, version = name.split("-")[:2]
        print(f"{dist}=={version}")
' >"$work/chunks.txt"

missing() {
  python3 - "$1" "$2" <<'PY'
import re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n.lower())
have = {norm(l.split("==")[0]) for l in open(sys.argv[1]) if "==" in l}
for line in open(sys.argv[2]):
    line = line.split("#")[0].strip()
    if "==" not in line:
        continue
    name = norm(line.split("==")[0].split("[")[0])
    cuda = name in ("torch", "triton") or name.startswith(("nvidia-", "cuda-"))
    if name not in have and not cuda:
        print(re.sub(r"\[.*\]", "", line))
PY
}

plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  plat+=(--platform "$p")
done
