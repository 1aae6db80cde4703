"""Hourly GPU prices from SkyPilot's catalog, written where `forgesky plan` reads them.

`forgesky plan` does not import SkyPilot (seconds), so the prices it shows come from a compact
table, recipes/price_catalog/offers.json (read by recipes/prices.py). This module writes that
table from SkyPilot's own catalog module, `sky.catalog`, in a child process whose
SKY_RUNTIME_DIR is set before SkyPilot is imported:

- live (`forgesky prices --refresh`): SkyPilot's catalog as it keeps it (~/.sky/catalogs,
  fetched by SkyPilot when stale), for every cloud in CLOUDS it can read;
- snapshot (`forgesky prices --refresh --snapshot`): the rows of SkyPilot's catalog files
  committed in recipes/price_catalog/catalogs (SOURCE.md there says which and when), for
  machines without the internet.

Each offer is one instance type of one cloud with `count` GPUs of one type, its vCPUs, its
cheapest on-demand and spot price an hour over the regions the catalog lists, and those regions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path
from typing import Any

from recipes.prices import OFFERS_FILE, SNAPSHOT_DATE, SNAPSHOT_DIR

# The clouds asked (live) and the GPU types, by forgesky's name and the names clouds sell them by.
CLOUDS = ("aws", "gcp", "azure", "lambda", "runpod", "nebius", "oci")
ACCELERATORS = {
    "H100": ("H100", "H100-SXM"),
    "H200": ("H200", "H200-SXM"),
    "A100-80GB": ("A100-80GB",),
    "B200": ("B200",),
}
COUNTS = (1, 2, 4, 8)


def collect(clouds: tuple[str, ...]) -> dict[str, Any]:
    """Ask `sky.catalog` for every offer of ACCELERATORS x COUNTS on `clouds` (in this process:
    SKY_RUNTIME_DIR must already say where the catalog is). A cloud whose catalog cannot be
    read is listed under "unread" with why."""
    import sky.catalog as catalog

    offers: list[dict[str, Any]] = []
    unread: dict[str, str] = {}
    for cloud in clouds:
        try:
            catalog.list_accelerators(gpus_only=True, clouds=cloud)
        except Exception as e:  # no file and no network, a cloud this SkyPilot lacks, ...
            unread[cloud] = f"{type(e).__name__}: {e}".splitlines()[0]
            continue
        for name, sold_as in ACCELERATORS.items():
            for count in COUNTS:
                for sky_name in sold_as:
                    offers.extend(_offers(catalog, cloud, name, sky_name, count))
    return {"offers": offers, "unread": unread}


def _offers(catalog: Any, cloud: str, name: str, sky_name: str, count: int) -> list[dict]:
    try:
        types, _ = catalog.get_instance_type_for_accelerator(sky_name, count, clouds=cloud)
    except Exception:
        return []
    out = []
    for instance_type in types or ():
        offer: dict[str, Any] = {
            "cloud": cloud,
            "accelerator": name,
            "count": count,
            "instance_type": instance_type,
            "vcpus": _vcpus(catalog, cloud, instance_type),
        }
        for kind, spot in (("on_demand", False), ("spot", True)):
            prices = []
            try:
                regions = catalog.get_region_zones_for_instance_type(
                    instance_type, spot, clouds=cloud
                )
            except Exception:  # Lambda sells no spot
                regions = []
            for region in regions:
                try:
                    price = _node_price(
                        catalog, cloud, instance_type, sky_name, count, spot, region
                    )
                except Exception:  # no such price in that region (a NaN column, no GPU row)
                    continue
                if price == price:  # NaN is no price
                    prices.append((float(price), region.name))
            # ties go to the region SkyPilot lists first
            price, region = min(prices, key=lambda pr: pr[0], default=(None, None))
            offer[kind] = None if price is None else round(price, 5)
            offer[f"{kind}_region"] = region
        if offer["on_demand"] is not None or offer["spot"] is not None:
            out.append(offer)
    return out


def _vcpus(catalog: Any, cloud: str, instance_type: str) -> float | None:
    """The instance type's vCPUs as the catalog lists them (None where it does not)."""
    try:
        vcpus, _ = catalog.get_vcpus_mem_from_instance_type(instance_type, clouds=cloud)
    except Exception:
        return None
    return None if vcpus is None or vcpus != vcpus else float(vcpus)


def _node_price(
    catalog: Any, cloud: str, instance_type: str, sky_name: str, count: int, spot: bool, region
) -> float:
    """What SkyPilot prices a node at in `region` (sky.Resources' hourly cost): the instance
    plus its accelerators where the cloud prices them apart (GCP lists its GPUs in rows of
    their own, its A2/A3/A4 rows price the host; the other clouds' instance price holds the
    GPUs, and their accelerators cost 0)."""
    from sky.utils.registry import CLOUD_REGISTRY

    price = catalog.get_hourly_cost(instance_type, spot, region.name, None, clouds=cloud)
    sky_cloud = CLOUD_REGISTRY.from_str(cloud)
    return price + sky_cloud.accelerators_to_hourly_cost({sky_name: count}, spot, region.name)


def collect_in_child(runtime_dir: Path | None, clouds: tuple[str, ...]) -> dict[str, Any]:
    """`collect` in a fresh Python process (SkyPilot reads SKY_RUNTIME_DIR once, at import):
    SkyPilot's catalog under `runtime_dir`/.sky/catalogs, or where SkyPilot keeps it (None)."""
    env = dict(os.environ)
    if runtime_dir is not None:
        env["SKY_RUNTIME_DIR"] = str(runtime_dir)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "offers.json"
        # SkyPilot writes its progress to stdout: the answer goes to a file
        done = subprocess.run(
            [sys.executable, "-m", "launcher.prices", str(out), *clouds],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            cwd=Path(__file__).resolve().parent.parent,
        )
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"reading SkyPilot's catalog failed: {tail}")
        return json.loads(out.read_text())


def snapshot_offers() -> dict[str, Any]:
    """The offers table from the committed snapshot (what offers.json holds)."""
    if not (SNAPSHOT_DIR / "v8").is_dir():
        raise RuntimeError(
            f"no snapshot of SkyPilot's catalog at {SNAPSHOT_DIR} (it is in forgesky's source "
            "checkout, not in the wheel)"
        )
    clouds = tuple(sorted(p.name for p in (SNAPSHOT_DIR / "v8").iterdir() if p.is_dir()))
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(SNAPSHOT_DIR, Path(tmp) / ".sky" / "catalogs")
        got = collect_in_child(Path(tmp), clouds)
    return table(got, f"snapshot of SkyPilot's catalog ({', '.join(clouds)})", SNAPSHOT_DATE)


def live_offers(
    runtime_dir: Path | None = None, clouds: tuple[str, ...] = CLOUDS
) -> dict[str, Any]:
    """The offers table from SkyPilot's catalog where it keeps it (`runtime_dir`: another)."""
    got = collect_in_child(runtime_dir, clouds)
    read = [c for c in clouds if c not in got["unread"]]
    if not read:
        kinds = sorted({why.split(":")[0] for why in got["unread"].values()})
        raise RuntimeError(
            f"SkyPilot's catalog could not be read for any cloud ({', '.join(clouds)}: "
            f"{', '.join(kinds)}; offline?)"
        )
    return table(got, f"SkyPilot's catalog ({', '.join(read)})", date.today().isoformat())


def table(got: dict[str, Any], source: str, day: str) -> dict[str, Any]:
    offers = sorted(
        got["offers"], key=lambda o: (o["accelerator"], o["count"], o["cloud"], o["instance_type"])
    )
    return {"source": source, "date": day, "offers": offers}


def write(data: dict[str, Any], path: Path = OFFERS_FILE) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(collect(tuple(sys.argv[2:]))))
