"""How a stored row becomes the sample a dataset returns, transforms applied.

One rule for ``PackedDataset`` and ``CachedDataset``: a tuple gets ``transform`` on its
first element and ``target_transform`` on its second, as torchvision's ``ImageFolder``
(``(image, label)``); a dict or a single value gets ``transform`` on the whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def apply_transforms(structure: str, names: list[str], values: list[Any],
                     transform: Callable[[Any], Any] | None,
                     target_transform: Callable[[Any], Any] | None) -> Any:
    if structure == "dict":
        sample: Any = dict(zip(names, values, strict=True))
        return transform(sample) if transform else sample
    if structure == "single":
        return transform(values[0]) if transform else values[0]
    values = list(values)
    if transform is not None and values:
        values[0] = transform(values[0])
    if target_transform is not None and len(values) > 1:
        values[1] = target_transform(values[1])
    return tuple(values)
