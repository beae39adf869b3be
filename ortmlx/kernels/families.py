"""Imports every translator module so that their ops register."""
import importlib
import pkgutil

from . import ops as _ops

for _m in pkgutil.iter_modules(_ops.__path__):
    importlib.import_module(f"{_ops.__name__}.{_m.name}")
