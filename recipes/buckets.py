"""Bucket URLs: the object stores SkyPilot copies from and mounts, and what a well-formed URL is.

Two settings take one: `--checkpoint-bucket` (the run directory, mounted on the nodes) and a
model folder a run starts from (`model.hf_id`, `model.tokenizer`: an SFT run's exported model,
say), which `forgesky launch` copies to every node. Checked by form only, with no network: what
the bucket holds is SkyPilot's to find at launch.
"""

from __future__ import annotations

import re
import urllib.parse

# Store URL schemes SkyPilot mounts and copies (sky.data.storage.StoreType prefixes, all in
# sky.cloud_stores); https:// is Azure blob. Hugging Face buckets (hf://) are left out: a
# checkpoint mount needs a writable object store, and a Hub model is named as it is on the Hub.
BUCKET_SCHEMES = ("s3", "gs", "r2", "cos", "oci", "nebius", "cw", "vastdata", "https")
_BUCKET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_AZURE_HOST = ".blob.core.windows.net"


def is_url(value: str) -> bool:
    """Written as a URL (scheme://...): a bucket path, or a mistake to report."""
    return "://" in value


def bucket_problem(url: str) -> str | None:
    """What is wrong with `url` as a bucket URL SkyPilot can reach (s3://bucket/path, ...), in a
    few words; None when it is well formed."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in BUCKET_SCHEMES:
        import difflib

        # https:// is Azure's alone: not a guess for ftp:// or http://
        stores = [s for s in BUCKET_SCHEMES if s != "https"]
        close = difflib.get_close_matches(scheme, stores, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]}://?)" if close and scheme else ""
        kinds = ", ".join(f"{s}://" for s in stores)
        return f"not a bucket URL{hint}; use {kinds} or https://<account>{_AZURE_HOST}/<container>"
    if not parts.netloc or not _BUCKET_NAME.fullmatch(parts.netloc):
        return "bucket name missing or invalid"
    if parts.query or parts.fragment or " " in url:
        return "no spaces, '?' or '#' in a bucket URL"
    if scheme == "https" and (not parts.netloc.endswith(_AZURE_HOST) or not parts.path.strip("/")):
        return (
            "an https:// bucket must be an Azure blob container, "
            f"https://<account>{_AZURE_HOST}/<container>"
        )
    if scheme == "cos" and not parts.path.strip("/"):
        return "IBM COS URLs are cos://<region>/<bucket>"
    return None


def bucket_source(url: str) -> str:
    """A well-formed `url` as a file mount's source: SkyPilot refuses one ending in a slash, and
    knows schemes in lower case only."""
    scheme, rest = url.split("://", 1)
    return f"{scheme.lower()}://{rest}".rstrip("/")


def bucket_leaf(url: str) -> str:
    """The last name of a well-formed bucket URL's path (the bucket's, for its root): the
    folder's name on the nodes."""
    parts = urllib.parse.urlsplit(bucket_source(url))
    return parts.path.rstrip("/").rsplit("/", 1)[-1] or parts.netloc
