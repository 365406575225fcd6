"""The publication manifest object: its key, name rule and parser (pure, no client).

A publication ``name`` is one JSON object ``engramdb:{name}:manifest`` (written last by
`publish`, read first by `open_mooncake`) naming every table's geometry, store objects and
published views.
"""

from __future__ import annotations

import json
from typing import Any

from engramdb.errors import CorruptManifest, InvalidArgument

MANIFEST_FORMAT = "engramdb-mooncake"
MANIFEST_VERSION = 1


def manifest_key(name: str) -> str:
    """The store key of publication ``name``'s manifest object."""
    return f"engramdb:{name}:manifest"


def check_name(name: str) -> str:
    """``name`` if it is a valid publication name (no ':', '/' or whitespace), else
    `InvalidArgument`."""
    if not isinstance(name, str) or not name or any(c in name for c in ": \t\n/"):
        raise InvalidArgument(f"invalid publication name {name!r}: no ':', '/' or spaces")
    return name


def parse_manifest(raw: bytes, name: str) -> dict[str, Any]:
    """The manifest document of publication ``name`` from its object's bytes; raises
    `CorruptManifest` for anything but a publication this reader understands."""
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CorruptManifest(f"manifest object of {name!r} is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise CorruptManifest(f"object {manifest_key(name)!r} is not an EngramDB publication")
    if doc.get("format_version") != MANIFEST_VERSION:
        raise CorruptManifest(
            f"publication {name!r} has format_version {doc.get('format_version')!r}, this "
            f"reader understands {MANIFEST_VERSION}"
        )
    return doc


__all__ = ["MANIFEST_FORMAT", "MANIFEST_VERSION", "check_name", "manifest_key", "parse_manifest"]
