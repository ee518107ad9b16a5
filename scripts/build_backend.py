"""setuptools' build backend, minus its editable-install notice.

pip >= 26 prints the warnings a build backend raises. For a package whose directory is mapped (kernels/ ->
hf_fp8kv.kernels), setuptools' editable install always raises an informational "Editable installation."
warning; `pip install -e .` would print it on every install. Every other warning still shows.
"""

import warnings

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F401,F403  (the PEP 517 hooks, unchanged)
from setuptools.warnings import InformationOnly


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Editable installation", InformationOnly)
        return build_meta.build_editable(wheel_directory, config_settings, metadata_directory)
