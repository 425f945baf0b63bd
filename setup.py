"""The compiled part of kvlife: one C extension (the disk tier's verified reads of a run
of frames outside the interpreter lock, issue 28). Everything else is in pyproject.toml.

``optional=True``: where no C compiler is found the build goes on without it, and the
disk tier reads through its Python path (``kvlife.native.frames.available()`` says
which; docs/store.md)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvlife.native._frames",
            ["kvlife/native/_frames.c"],
            extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE"],
            optional=True,
        )
    ]
)
