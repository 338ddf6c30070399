"""Every op family; importing this package registers all ops and kernel modules.

A new family is a module here (``gpuops/ops/<family>.py``) beside ``cuda_src/<family>/`` and
``tests/test_<family>.py``, added to the import list below.
"""
from gpuops.ops import elementwise  # noqa: F401
