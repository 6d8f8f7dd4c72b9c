"""What pyproject.toml cannot say: the autostart ``.pth`` and the recorder's compiled part.

- ``ncclguard-autostart.pth`` goes to the top of site-packages. A ``.pth`` file there is read at
  every interpreter start; its one line imports the start-up hook
  (``autostart/ncclguard_autostart.py``) only when ``NCCLGUARD_AUTO`` is set. setuptools installs
  files of packages only, so ``build_py`` copies the ``.pth`` beside them: into the wheel's root for
  a regular install, into the editable wheel for ``pip install -e`` (whose build directory is thrown
  away).
- ``ncclguard.recording._hotpath`` (the recording wrapper of ``instrument()`` in C, issue 29) builds
  with the C compiler Python was built with, in about a second. It is optional: where it cannot be
  built, the install goes on and ``instrument()`` uses the Python wrapper, which records the same.
"""

from __future__ import annotations

import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

PTH = "ncclguard-autostart.pth"


class BuildPyWithPth(build_py):
    """``build_py``, then the ``.pth`` where the wheel's top level is made."""

    def run(self) -> None:
        super().run()
        editable = getattr(self, "editable_mode", False)
        top = self.get_finalized_command("install").install_lib if editable else self.build_lib
        self.copy_file(os.path.join("autostart", PTH), os.path.join(top, PTH), preserve_mode=False)


setup(
    cmdclass={"build_py": BuildPyWithPth},
    ext_modules=[
        Extension(
            "ncclguard.recording._hotpath",
            sources=["ncclguard/recording/_hotpath.c"],
            optional=True,
        )
    ],
)
