"""pytest plugin (``-p cuda_tests``): keep only the tests marked ``gpu`` or skipped for want of CUDA.

A test counts as CUDA-skipping when a ``skipif`` marker on it gives a reason that names CUDA or a GPU
("no CUDA", "needs a CUDA GPU", ...). Tests that call ``pytest.skip`` inside their body are not seen
here; they are marked ``gpu`` in this repository.
"""

from __future__ import annotations

import re

_CUDA = re.compile(r"\b(cuda|gpu)\b", re.IGNORECASE)


def wants_cuda(item) -> bool:
    if item.get_closest_marker("gpu") is not None:
        return True
    return any(_CUDA.search(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    keep = [i for i in items if wants_cuda(i)]
    drop = [i for i in items if not wants_cuda(i)]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
