"""Compatibility shim: the Mooncake view code lives in `engramdb.integrations.mooncake.views`."""

from engramdb.integrations.mooncake.views import *  # noqa: F403
from engramdb.integrations.mooncake.views import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_MERGE_GAP_BYTES,
    PublishedView,
    ViewReader,
    index_bytes,
    parse_views,
    publish_view,
)

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_MERGE_GAP_BYTES",
    "PublishedView",
    "ViewReader",
    "index_bytes",
    "parse_views",
    "publish_view",
]
