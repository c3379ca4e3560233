"""``DevicePrefetcher``: batches copied to the device ahead of use, images normalised there.

What the ``cpu_transforms`` and ``collate`` findings and the host-to-device rules ask
for, in the shape of timm's ``PrefetchLoader`` + ``fast_collate``
(data-loading.md §3, pitfall 5): keep images ``uint8`` through the workers and the
collate (4× fewer bytes to stack, pickle and copy than ``float32``), copy them to the
device, and there turn them into floats, run the batched augmentations and
normalise: one vectorised op per batch instead of numpy float32 work per sample.

On CUDA the next batch is copied on a side stream while the current one trains
(``non_blocking=True``; the copy is asynchronous only from pinned memory, so give the
DataLoader ``pin_memory=True``), the compute stream waits for it before using it, and
``record_stream`` tells the caching allocator the tensors are used there. On the CPU
the same code runs with no stream: the conversion is still one batched op.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch


class DevicePrefetcher:
    """Iterate ``loader``'s batches on ``device``, the image field converted to float.

    The image field (``image_field``: an index of a tuple/list batch, a key of a dict
    batch, ignored for a plain tensor) goes ``uint8`` → ``float32`` / ``scale`` →
    ``batch_transform`` (batched augmentations, on the device) → ``(x - mean) / std``
    → ``channels_last`` if asked. Every other tensor is moved as it is.
    """

    def __init__(self, loader: Any, device: torch.device | str | None = None, *,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 scale: float = 255.0, image_field: int | str = 0,
                 batch_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 channels_last: bool = False) -> None:
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither")
        self.loader = loader
        self.device = torch.device(device if device is not None else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        self.scale = float(scale)
        self.image_field = image_field
        self.batch_transform = batch_transform
        self.channels_last = channels_last
        shape = (1, -1, 1, 1)
        self.mean = (None if mean is None else
                     torch.tensor(mean, dtype=torch.float32, device=self.device).view(shape))
        self.std = (None if std is None else
                    torch.tensor(std, dtype=torch.float32, device=self.device).view(shape))
        if self.device.type == "cuda" and getattr(loader, "pin_memory", True) is False:
            warnings.warn(
                "DevicePrefetcher: the DataLoader has pin_memory=False, so copies to the GPU "
                "wait for the host (non_blocking needs pinned memory): pass pin_memory=True",
                stacklevel=2,
            )

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            for batch in self.loader:
                yield self._prepare(batch)
            return
        stream = torch.cuda.Stream(device=self.device)
        current = torch.cuda.current_stream(self.device)
        pending: Any = None
        for batch in self.loader:
            with torch.cuda.stream(stream):
                ready = self._prepare(batch)
            if pending is not None:
                yield pending
            current.wait_stream(stream)  # the copy and conversion are done before use
            _record_stream(ready, current)
            pending = ready
        if pending is not None:
            yield pending

    # -- one batch -----------------------------------------------------------------------
    def _prepare(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return self._image(batch)
        if isinstance(batch, dict):
            return {k: self._image(v) if k == self.image_field else self._move(v)
                    for k, v in batch.items()}
        if isinstance(batch, tuple | list):
            items = [self._image(v) if i == self.image_field else self._move(v)
                     for i, v in enumerate(batch)]
            return type(batch)(items) if isinstance(batch, list) else tuple(items)
        return batch

    def _move(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.device, non_blocking=True)
        if isinstance(value, dict):
            return {k: self._move(v) for k, v in value.items()}
        if isinstance(value, tuple | list):
            return type(value)(self._move(v) for v in value)
        return value

    def _image(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device, non_blocking=True)
        if not x.is_floating_point():
            x = x.float().div_(self.scale)
        if self.batch_transform is not None:
            x = self.batch_transform(x)
        if self.mean is not None and self.std is not None:
            x = x.sub_(self.mean).div_(self.std) if x.dim() == 4 else (
                x.sub(self.mean.view(-1, 1, 1)).div(self.std.view(-1, 1, 1)))
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x


def _record_stream(value: Any, stream: Any) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif isinstance(value, dict):
        for v in value.values():
            _record_stream(v, stream)
    elif isinstance(value, tuple | list):
        for v in value:
            _record_stream(v, stream)
