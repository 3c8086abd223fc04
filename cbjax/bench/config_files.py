"""Experiment config files are loaded by path (ml_collections' --config=FILE), not imported as a package; a
config that extends another loads its sibling file by path too, through this one helper."""

import importlib.util
import os


def sibling_config(here: str, name: str):
    """`get_config()` of the config file `name` in the folder of `here` (pass `__file__`)."""
    path = os.path.join(os.path.dirname(os.path.abspath(here)), name)
    spec = importlib.util.spec_from_file_location(os.path.splitext(name)[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()
