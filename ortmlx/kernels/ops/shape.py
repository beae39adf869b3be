"""Shape ops."""
from __future__ import annotations

import numpy as np

from ..registry import register


def _shape_host(data, *, start=0, end=None):
    return np.array(data.shape[start:end], dtype=np.int64)


@register("Shape", 15, host=_shape_host, shape_only=True)
def shape(data, *, start=0, end=None):
    return _shape_host(data, start=start, end=end)
