"""The one compiled part: ``engramdb.io._columns`` (a gather of rows assembled from several
column sources). ``optional``: without a C compiler the package installs and reads through
numpy instead (``engramdb.io.gather.take_columns``)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "engramdb.io._columns",
            ["engramdb/io/_columns.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
