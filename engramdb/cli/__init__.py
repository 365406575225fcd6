"""The ``engramdb`` command line: thin click commands, one library call each."""

from __future__ import annotations

import click

from engramdb._version import __version__
from engramdb.cli.attach_cmd import attach_cmd
from engramdb.cli.bench_cmd import bench_cmd
from engramdb.cli.build_cmd import build_cmd
from engramdb.cli.demo_cmd import demo_cmd
from engramdb.cli.index_cmd import index_cmd
from engramdb.cli.info_cmd import drop_cmd, gc_cmd, info_cmd, verify_cmd
from engramdb.cli.publish_cmd import publish
from engramdb.cli.serve_cmd import serve
from engramdb.cli.view_cmd import view_group
from engramdb.cli.warm_cmd import warm_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="engramdb")
def main() -> None:
    """EngramDB: a disk-first database for Engram / PLE n-gram embedding tables.

    \b
    Typical chain (DB comes first in every command):
      engramdb build DB emb.npy --table ple --row-bytes 256
      engramdb index DB corpus.npy --preset P --table ple
      engramdb view build DB --table ple --view hot --from-index
      engramdb warm DB --table ple
      engramdb serve DB
      engramdb bench --quick --plot bench.png

    \b
    Glossary:
      Store-I  the table itself: one row per row id, in shards (build / attach)
      Store-P  a view: one fixed-size record per n-gram key, the rows of all its
               heads side by side, laid out in corpus access order (view build)
      head     one hash function's slice of a table; a lookup reads one row per head
      badge    the block of rows shards are cut in: its bytes tile whole pages
               (2 MiB where it can; rows/badge in info)
      index    what `engramdb index` counted: hot rows and keys in access order

    Every command that reports a result takes --json; progress lines go to stderr
    and only to a terminal.
    """


main.add_command(build_cmd)
main.add_command(attach_cmd)
main.add_command(info_cmd)
main.add_command(verify_cmd)
main.add_command(drop_cmd)
main.add_command(gc_cmd)
main.add_command(demo_cmd)
main.add_command(index_cmd)
main.add_command(warm_cmd)
main.add_command(serve)
main.add_command(publish)
main.add_command(view_group)
main.add_command(bench_cmd)
