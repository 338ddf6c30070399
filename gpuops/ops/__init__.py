"""Every op family. Importing this package imports each module in it, which registers the family's
ops and kernel modules: a new family is just a new file here (``gpuops/ops/<family>.py``, beside
``cuda_src/<family>/`` and ``tests/test_<family>.py``), with no list to edit."""
import importlib
import pkgutil

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
del _info
