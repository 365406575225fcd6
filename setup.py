"""The compiled parts, all optional (without a C compiler the package installs and runs on
its Python paths): ``engramdb.io._columns``, a gather of rows assembled from several column
sources (``engramdb.io.columns``); ``engramdb.io._submitter``, a thread that submits a
decode step's reads without the GIL (``engramdb.io.sqpoll``); ``engramdb.io._pieces``, a
background-warm piece in one call without the GIL (``engramdb.io.foreground``);
``engramdb.keygen._native``, the row ids of a decode step's few positions in one call
(``engramdb.keygen._core``)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            f"engramdb.{name}",
            [f"engramdb/{name.replace('.', '/')}.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
        for name in ("io._columns", "io._submitter", "io._pieces", "keygen._native")
    ]
)
