"""The compiled parts, both optional (without a C compiler the package installs and runs on
its Python paths): ``engramdb.io._columns``, a gather of rows assembled from several column
sources (``engramdb.io.columns``), and ``engramdb.io._submitter``, a thread that submits a
decode step's reads without the GIL (``engramdb.io.sqpoll``)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            f"engramdb.io.{name}",
            [f"engramdb/io/{name}.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
        for name in ("_columns", "_submitter")
    ]
)
