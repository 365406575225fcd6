"""EngramDB tables in a Mooncake distributed store.

Three pieces, all on a ``mooncake.store.MooncakeDistributedStore`` client (the optional extra
``engramdb[mooncake]``):

* `ObjectLayout` — pure geometry: which store object holds a row, and the per-object byte
  ranges of a batch (vectorised with numpy, no I/O), so it can be tested without a store;
* `MooncakeLayers` — the Mooncake backing of `EngramStore` (create-only ``populate``, one
  ``get_into_ranges`` per ``lookup_into``, ``remove_from_store``);
* `publish` / `open_mooncake` — stream a whole EngramDB database into the store under a
  name, with a manifest object that lets any host discover the layout, and open it again
  as a database whose tables have ``fetch`` / ``fetch_into`` / ``lookup_into``; the tables'
  Store-P views go along and serve corpus streams (``use_view``).

Cost model (measured on this project's 2-core test machine, TCP transport over loopback;
see docs/distributed.md): the store client spends ~30-40 us of its own CPU per byte range in
``get_into_ranges`` whatever the range size, so a ranged lookup runs at ~20-35 k rows/s.
That holds wherever the replica lives, even in the reading client's own segment with
``MC_STORE_MEMCPY=1`` (the wheel's local-memcpy path serves whole-object reads only; ranged
reads always take the transfer engine, one request per range), and no TCP knob lowers it
(what an RDMA transport changes is not measured here). So the fast paths cut the number of
ranges: a corpus stream reads a published Store-P view (`engramdb.integrations.mooncake.views`:
the batch's records in a few long runs, ~2 M rows/s measured), and a table whose rows must
be served faster than ranged reads allow from a host that can hold it uses ``host_copy``:
the host pulls each object once (bulk reads) into one tmpfs file that every rank on the
host maps, and lookups become a local gather.

The package's modules import in one direction, ``tables`` → ``views`` / ``publish`` →
``_store`` (client plumbing) / ``layout`` / ``manifest`` (pure), ``layers`` → ``_store`` /
``layout``; this ``__init__`` re-exports their public names.

Importing this package never imports the ``mooncake`` package; connecting does, and raises
`MissingDependency` naming the extra when it is absent.
"""

from __future__ import annotations

# Each piece's public names (its ``__all__``) are this package's.
from engramdb.integrations.mooncake import _store
from engramdb.integrations.mooncake import install as _install
from engramdb.integrations.mooncake import layers as _layers
from engramdb.integrations.mooncake import layout as _layout
from engramdb.integrations.mooncake import manifest as _manifest
from engramdb.integrations.mooncake import publish as _publish
from engramdb.integrations.mooncake import tables as _tables
from engramdb.integrations.mooncake._store import *  # noqa: F403
from engramdb.integrations.mooncake.install import *  # noqa: F403
from engramdb.integrations.mooncake.layers import *  # noqa: F403
from engramdb.integrations.mooncake.layout import *  # noqa: F403
from engramdb.integrations.mooncake.manifest import *  # noqa: F403
from engramdb.integrations.mooncake.publish import *  # noqa: F403
from engramdb.integrations.mooncake.tables import *  # noqa: F403
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
    *_store.__all__,
    *_install.__all__,
    *_layers.__all__,
    *_layout.__all__,
    *_manifest.__all__,
    *_publish.__all__,
    *_tables.__all__,
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_MERGE_GAP_BYTES",
    "PublishedView",
    "ViewReader",
    "index_bytes",
    "parse_views",
    "publish_view",
]
