"""The package as it ships: every folder of modules is a package a wheel carries."""

from __future__ import annotations

import os

from setuptools import find_packages

from tests.helpers import REPO


def test_every_folder_of_modules_is_a_package_the_wheel_carries():
    # a folder without __init__.py imports from a checkout (a namespace package) but
    # setuptools' find leaves it out of the wheel: the installed tool would lack it
    root = REPO / "dspark_calib"
    folders = {os.path.relpath(d, REPO).replace(os.sep, ".") for d, _, files in os.walk(root)
               if "__pycache__" not in d and any(f.endswith(".py") for f in files)}
    assert folders == set(find_packages(str(REPO), include=["dspark_calib*"]))
