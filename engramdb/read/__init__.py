"""The read engine under every local handle: read planning (`plan`), the RAM tier (`cache`),
background reads (`prefetch`, over its `RowSource` protocol) and `table.LocalTable`, the
table with the package's trusted read API for validated ids."""
