"""What a node of GPUs costs an hour, on demand and spot, and where it is cheapest.

The prices are SkyPilot's: recipes/price_catalog/offers.json holds what its catalog module
(`sky.catalog`) answered, written by `forgesky prices --refresh` (launcher/prices.py), and
names its source and date. Plans read that file, not SkyPilot (which takes seconds to import).
Offline, the table comes from the committed snapshot of SkyPilot's catalog files in
recipes/price_catalog/catalogs (SOURCE.md there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).resolve().parent / "price_catalog"
OFFERS_FILE = HERE / "offers.json"
SNAPSHOT_DIR = HERE / "catalogs"
SNAPSHOT_DATE = "2026-11-29"


@dataclass(frozen=True)
class Offer:
    """One instance type: `count` GPUs of `accelerator` on `cloud`, its cheapest hourly price
    over the catalog's regions (None: not sold that way) and that region, and its vCPUs (None
    where the catalog lists none)."""

    cloud: str
    accelerator: str
    count: int
    instance_type: str
    on_demand: float | None
    on_demand_region: str | None
    spot: float | None
    spot_region: str | None
    vcpus: float | None = None

    def price(self, spot: bool) -> float | None:
        return self.spot if spot else self.on_demand

    def where(self, spot: bool) -> str:
        region = self.spot_region if spot else self.on_demand_region
        return f"{self.cloud} {region}, {self.instance_type}"


@dataclass(frozen=True)
class PriceBook:
    source: str
    date: str
    offers: tuple[Offer, ...]

    @property
    def words(self) -> str:
        return f"{self.source}, {self.date}"

    def cheapest(
        self, accelerator: str, per_node: int, spot: bool, cloud: str | None = None
    ) -> Offer | None:
        """The cheapest node of exactly `per_node` GPUs of `accelerator` (on `cloud` where
        given), or None."""
        sold = [
            o
            for o in self.offers
            if o.accelerator == accelerator
            and o.count == per_node
            and o.price(spot) is not None
            and (cloud is None or o.cloud == cloud)
        ]
        return min(sold, key=lambda o: (o.price(spot), o.cloud), default=None)

    def fewest_vcpus(self, accelerator: str, per_node: int) -> Offer | None:
        """The offer of `per_node` GPUs of `accelerator` with the fewest vCPUs (the least a
        node of them has, whichever cloud SkyPilot picks), or None."""
        listed = [
            o
            for o in self.offers
            if o.accelerator == accelerator and o.count == per_node and o.vcpus is not None
        ]
        return min(listed, key=lambda o: (o.vcpus, o.cloud), default=None)

    def counts(self, accelerator: str) -> tuple[int, ...]:
        """GPUs a node of `accelerator` comes with in some offer."""
        return tuple(sorted({o.count for o in self.offers if o.accelerator == accelerator}))

    def cloud_of(self, infra: str | None) -> str | None:
        """The cloud an --infra value (`aws`, `gcp/us-central1`, `k8s`) names, where the table
        prices it; else None (every cloud)."""
        cloud = (infra or "").split("/")[0].strip().lower()
        return cloud if any(o.cloud == cloud for o in self.offers) else None


@lru_cache(maxsize=4)
def price_book(path: Path = OFFERS_FILE) -> PriceBook:
    data = json.loads(Path(path).read_text())
    return PriceBook(
        source=data["source"],
        date=data["date"],
        offers=tuple(Offer(**o) for o in data["offers"]),
    )


def dollars(amount: float) -> str:
    """$ in words: cents below $100, whole dollars above."""
    return f"${amount:,.2f}" if amount < 100 else f"${amount:,.0f}"
