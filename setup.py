"""Only the compiled part of the recorder; everything else about the package is in pyproject.toml.

``ncclguard.recording._hotpath`` (the recording wrapper of ``instrument()`` in C, issue 29) builds
with the C compiler Python was built with, in about a second. It is optional: where it cannot be
built, the install goes on and ``instrument()`` uses the Python wrapper, which records the same.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ncclguard.recording._hotpath",
            sources=["ncclguard/recording/_hotpath.c"],
            optional=True,
        )
    ]
)
