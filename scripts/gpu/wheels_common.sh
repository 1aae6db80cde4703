# Sourced by prepare_extra_wheels.sh and prepare_verl_wheels.sh, at the checkout's top ($top):
# what both need before they resolve against the GPU machine. It checks that the stack's chunks
# (.whl/cNN) and the image's package list ($image) are there, gets uv, makes a work folder
# ($work, removed on exit) and writes $work/chunks.txt: name==version of every wheel in the
# chunks (one tar split across .whl/cNN).
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
