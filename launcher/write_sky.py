"""`python -m launcher.write_sky`: regenerate sky/*.yaml and the catalog's index from the recipes.

Per recipe two files, each what `forgesky render` writes: NAME.yaml for `sky launch` at the
recipe's minimum GPUs, and NAME-spot.yaml, a managed job on spot instances for `sky jobs launch`.
recipes/catalog/index.json holds what `forgesky recipes` lists, so listing needs no schema.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launcher import catalog
from launcher.cli import build_parser, render_text
from launcher.options import PROJECT_DIR
from recipes import list_recipes

SKY_DIR = PROJECT_DIR / "sky"


def variants(name: str) -> list[list[str]]:
    """The `forgesky` argument lists whose output lands in sky/ for catalog recipe `name`."""
    return [
        ["render", name, "-o", f"sky/{name}.yaml"],
        ["render", name, "--managed", "--spot", "-o", f"sky/{name}-spot.yaml"],
    ]


def generate() -> dict[str, str]:
    """File name -> content of every file sky/ should hold."""
    parser = build_parser()
    files = {}
    for name in list_recipes():
        for argv in variants(name):
            args = parser.parse_args(argv)
            args.argv = argv
            files[Path(args.output).name] = render_text(args)
    return files


def write(out_dir: Path = SKY_DIR) -> list[Path]:
    """Write every file into `out_dir`, removing stale *.yaml there; returns the written paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = generate()
    for stale in out_dir.glob("*.yaml"):
        if stale.name not in files:
            stale.unlink()
    written = []
    for file_name, text in sorted(files.items()):
        path = out_dir / file_name
        path.write_text(text)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """Regenerate the SkyPilot YAMLs (default: the repository's sky/)."""
    parser = argparse.ArgumentParser(prog="python -m launcher.write_sky", description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=SKY_DIR, help="default: sky/")
    args = parser.parse_args(argv)
    for path in write(args.out_dir):
        print(path)
    catalog.INDEX.write_text(catalog.index_text())
    print(catalog.INDEX)
    return 0


if __name__ == "__main__":
    sys.exit(main())
