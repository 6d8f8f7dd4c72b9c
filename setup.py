"""Everything is in pyproject.toml but one step: ncclguard-autostart.pth goes to the top of site-packages.

A ``.pth`` file there is read at every interpreter start; its one line imports the start-up hook
(``autostart/ncclguard_autostart.py``) only when ``NCCLGUARD_AUTO`` is set. setuptools installs
files of packages only, so ``build_py`` copies the ``.pth`` beside them: into the wheel's root for a
regular install, into the editable wheel for ``pip install -e`` (whose build directory is thrown away).
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "ncclguard-autostart.pth"


class BuildPyWithPth(build_py):
    """``build_py``, then the ``.pth`` where the wheel's top level is made."""

    def run(self) -> None:
        super().run()
        editable = getattr(self, "editable_mode", False)
        top = self.get_finalized_command("install").install_lib if editable else self.build_lib
        self.copy_file(os.path.join("autostart", PTH), os.path.join(top, PTH), preserve_mode=False)


setup(cmdclass={"build_py": BuildPyWithPth})
