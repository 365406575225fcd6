"""The compiled parts, both optional (without a C compiler the package installs and runs on
its Python paths): ``engramdb.io._columns``, a gather of rows assembled from several column
sources (``engramdb.io.columns``), and ``engramdb.io._submitter``, a thread that submits a
decode step's reads without the GIL (``engramdb.io.sqpoll``)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "engramdb.io._columns",
            ["engramdb/io/_columns.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "engramdb.io._submitter",
            ["engramdb/io/_submitter.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
