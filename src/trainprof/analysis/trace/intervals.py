"""Vectorised interval arithmetic on int64 nanoseconds (numpy, no per-interval Python).

An interval set is a pair ``(starts, ends)`` of equal-length int64 arrays. The
functions that return a *disjoint* set return it sorted, merged, and without
empty intervals. Merging joins intervals that touch (``start <= running end``),
as the TensorBoard plugin's ``range_utils.merge_ranges`` and HTA's
``merge_kernel_intervals`` both do, so lengths agree with theirs exactly.
"""

from __future__ import annotations

import numpy as np

EMPTY = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The disjoint union of intervals (touching ones merged, empty ones dropped)."""
    keep = ends > starts
    s = starts[keep]
    e = ends[keep]
    n = s.shape[0]
    if n == 0:
        return EMPTY
    order = np.argsort(s, kind="stable")
    s = s[order]
    e = np.maximum.accumulate(e[order])
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.greater(s[1:], e[:-1], out=new[1:])
    first = np.flatnonzero(new)
    last = np.empty_like(first)
    last[:-1] = first[1:] - 1
    last[-1] = n - 1
    return s[first], e[last]


def total(starts: np.ndarray, ends: np.ndarray) -> int:
    """Summed length of a disjoint set."""
    return int((ends - starts).sum()) if starts.size else 0


def clip(starts: np.ndarray, ends: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """A disjoint set cut to the window ``[lo, hi)``."""
    s = np.maximum(starts, lo)
    e = np.minimum(ends, hi)
    keep = e > s
    return s[keep], e[keep]


def covered(points: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """For each point, whether it lies in the disjoint set (half-open intervals)."""
    if starts.size == 0:
        return np.zeros(points.shape, dtype=bool)
    idx = np.searchsorted(starts, points, side="right") - 1
    ok = idx >= 0
    out = np.zeros(points.shape, dtype=bool)
    out[ok] = points[ok] < ends[idx[ok]]
    return out


def intersect(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Intersection of two disjoint sets (a disjoint set)."""
    if a[0].size == 0 or b[0].size == 0:
        return EMPTY
    bounds = np.unique(np.concatenate([a[0], a[1], b[0], b[1]]))
    left = bounds[:-1]
    inside = covered(left, *a) & covered(left, *b)
    return _segments_to_set(bounds, inside)


def subtract(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """``a`` minus ``b`` for disjoint sets (a disjoint set)."""
    if a[0].size == 0 or b[0].size == 0:
        return a
    bounds = np.unique(np.concatenate([a[0], a[1], b[0], b[1]]))
    left = bounds[:-1]
    inside = covered(left, *a) & ~covered(left, *b)
    return _segments_to_set(bounds, inside)


def _segments_to_set(bounds: np.ndarray, inside: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge the selected elementary segments ``[bounds[k], bounds[k+1])`` into intervals."""
    if not inside.any():
        return EMPTY
    flag = np.concatenate([[False], inside, [False]]).astype(np.int8)
    edges = np.diff(flag)
    start_idx = np.flatnonzero(edges == 1)
    end_idx = np.flatnonzero(edges == -1)
    return bounds[start_idx], bounds[end_idx]


def weighted_level_time(
    starts: np.ndarray, ends: np.ndarray, values: np.ndarray, lo: int, hi: int
) -> float:
    """∫ min(Σ values of intervals open at t, 1) dt over ``[lo, hi)`` (where the sum is > 0).

    The TensorBoard plugin's ``merge_ranges_with_value`` (Est. SM efficiency): a sweep
    over start/end points, a START before an END at equal times, the running sum clipped
    at 1 on each elementary segment.
    """
    if starts.size == 0 or hi <= lo:
        return 0.0
    times = np.concatenate([starts, ends])
    deltas = np.concatenate([values, -values]).astype(np.float64)
    kinds = np.concatenate([np.zeros(starts.size, np.int8), np.ones(ends.size, np.int8)])
    order = np.lexsort((kinds, times))
    times = times[order]
    level = np.cumsum(deltas[order])
    # the level on [t_k, t_{k+1}) is the running sum after every endpoint at t_k
    last_at_time = np.flatnonzero(np.r_[times[1:] != times[:-1], True])
    seg_start = times[last_at_time]
    seg_level = level[last_at_time]
    seg_end = np.r_[seg_start[1:], seg_start[-1]]
    s = np.maximum(seg_start, lo)
    e = np.minimum(seg_end, hi)
    length = np.where(e > s, e - s, 0).astype(np.float64)
    value = np.where(seg_level > 0, np.minimum(seg_level, 1.0), 0.0)
    return float((length * value).sum())
