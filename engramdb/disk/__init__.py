"""The file protocol every writer and checker shares (see docs/format.md).

* `engramdb.disk.files`: directory fsync, atomic replacement, opening files with their size
  checked against the manifest, the table's shards, available memory.
* `engramdb.disk.publish`: the database lock, the one manifest reader (size cap), atomic
  manifest writes, staging directories, garbage collection of tables and views.
* `engramdb.disk.checksum`: the hashing writer (whole file + 64 MiB blocks), the checker,
  and the one `Problem` type both report with.

Layer: imports only `errors`, `layouts` and the standard library (plus numpy / xxhash).
"""
