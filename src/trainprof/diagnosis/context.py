"""What every rule reads: the run summary, the steady-state step records, and shared analyses.

Rules are pure functions of a :class:`Context`. Analyses that more than one rule
needs (which steps are outliers, which outliers recur at a fixed period, which
recur at the epoch length) are computed once here, so that the rules agree on
who owns a symptom: a data-wait spike at every epoch boundary belongs to the
input pipeline, a GC-dominated spike to GC, any other recurring spike to
periodic overhead. That is how one bottleneck gets one finding (expert-rules.md
"Gaps" #3: TF's ordered ladder avoids double reporting).

All step analyses use the *steady-state* steps (after the warm-up that
:mod:`trainprof.analysis.steps` detects), the same steps the summary's
breakdown shares are computed over, so a rule's shares and the summary's agree.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from trainprof.analysis.steps import (  # noqa: F401 - the spike definition, re-exported
    EXTRA_BATCHES,
    PHASE_COLUMNS,
    SPIKE_ABS_S,
    SPIKE_REL,
    SPIKE_SIGMAS,
    complete_steps,
    outliers,
    outliers_by_kind,
    robust_scale,
)
from trainprof.analysis.system import outside_cores


def number(v: Any) -> float | None:
    """``v`` as a float when the summary holds a number there (not a bool, not None)."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


@dataclass
class PeriodFit:
    """Outliers that recur at a fixed period."""

    period: int
    residue: int  # members are at residue + k * period (steps after the first steady one)
    indices: np.ndarray  # the members: positions in the steady-state steps
    coverage: float  # members / slots of that period and phase in the whole window
    strays: int  # outliers that are not members (noise spikes on a busy machine)


#: Share of a period's excess in data wait above which it is the input pipeline's.
DATA_OWNED = 0.8

#: Candidate periods tried by :func:`fit_period` (bounds its cost on long runs).
_MAX_CANDIDATES = 8
#: Family-wise false-alarm rate of :func:`fit_period`: the chance that outliers scattered at
#: random (a busy machine) are taken for work done every N steps.
ALPHA = 0.01


def _binomial_tail(m: int, s: int, q: float) -> float:
    """P(X >= m) for X ~ Binomial(s, q): ``m`` of ``s`` slots hit by chance."""
    q = min(max(q, 0.0), 1.0)
    return float(sum(math.comb(s, j) * q**j * (1 - q) ** (s - j) for j in range(m, s + 1)))


def _slots(n: int, period: int, residue: int) -> int:
    """Positions ``residue + k period`` in ``range(n)``."""
    return max(0, (n - 1 - residue) // period + 1)


def _coarsen(fit: PeriodFit, n: int, need: int) -> PeriodFit:
    """Prefer a multiple of the period when the members it drops look like strays.

    Strays that happen to land on a sub-multiple grid (a noise spike at step 15 when
    evaluation runs at 10, 20, 30) make period 5 explain more outliers than period 10.
    Period ``m p`` wins when its grid is well covered and the members off it fill less
    than half of their own slots.
    """
    for m in (2, 3, 4, 5):
        big = m * fit.period
        best = None
        for j in range(m):
            r = fit.residue + j * fit.period
            sub = fit.indices[fit.indices % big == r % big]
            if best is None or len(sub) > len(best[1]):
                best = (r % big, sub)
        if best is None:
            continue
        r, sub = best
        slots = _slots(n, big, r)
        if len(sub) < need or slots == 0 or len(sub) / slots < 0.6:
            continue
        off_slots = _slots(n, fit.period, fit.residue) - slots
        off = len(fit.indices) - len(sub)
        if off_slots <= 0 or off / off_slots < 0.5:
            coarse = PeriodFit(period=big, residue=r, indices=sub,
                               coverage=min(1.0, len(sub) / slots), strays=fit.strays + off)
            return _coarsen(coarse, n, need)
    return fit


def fit_period(
    idx: np.ndarray, n: int, expected: int | None = None, min_occurrences: int = 3
) -> PeriodFit | None:
    """Do (most of) the outlier positions ``idx``, out of ``n`` steps, recur at a fixed period?

    A period ``p`` and phase ``r`` fit when the outliers at exactly ``r + k p`` fill at
    least 60% of the slots ``r + k p`` in the whole window: so a missed occurrence is
    tolerated, but three random spikes that happen to be equally spaced are not a period.
    Outliers off the grid are *strays* (noise spikes on a busy machine) and do not
    break the fit; they are just not members. Without an ``expected`` period (the
    epoch length), candidates are the most common gaps between outliers (and between
    every other outlier, to step over a stray), and at least ``min_occurrences``
    members are needed; with one, two members suffice, because nothing is fitted.
    A fit must also be unlikely by chance: if the outliers were scattered at random
    (density ``q = len(idx) / n``), the chance of ``m`` or more of the ``s`` slots being
    hit is a binomial tail; times the number of (period, phase) pairs tried, it must
    stay below :data:`ALPHA` (few slots, as when the period is a third of the run, are
    not enough on a noisy machine); with an ``expected`` period, known in advance, only
    one test is counted. The best fit has the most members, then the best coverage, then
    the shortest period; then a multiple of it is preferred if the extra members look
    like strays (:func:`_coarsen`). Matching is exact because work scheduled by
    ``step % N`` and epoch boundaries land on exact multiples; a tolerance would let
    short periods match noise (with +-1 step, a period of 6 accepts half of all positions).
    """
    idx = np.unique(np.asarray(idx, dtype=np.int64))
    need = 2 if expected else min_occurrences
    if len(idx) < need or n <= 0:
        return None
    if expected:
        candidates = [int(expected)]
    else:
        gaps = np.concatenate([np.diff(idx), idx[2:] - idx[:-2]])
        values, counts = np.unique(gaps[gaps >= 2], return_counts=True)
        candidates = [int(v) for v in values[np.argsort(-counts, kind="stable")][:_MAX_CANDIDATES]]
    candidates = [p for p in candidates if p >= 2]  # every step is the step itself
    tests = 1 if expected else sum(candidates)  # (period, phase) pairs tried: Bonferroni
    density = len(idx) / n
    best: tuple[tuple[int, float, int], PeriodFit] | None = None
    for p in candidates:
        residues, counts = np.unique(idx % p, return_counts=True)
        for r, count in zip(residues.tolist(), counts.tolist(), strict=True):
            if count < need:
                continue
            members = idx[idx % p == r]
            slots = _slots(n, p, r)
            coverage = len(members) / slots if slots > 0 else 0.0
            if coverage < 0.6 or _binomial_tail(len(members), slots, density) * tests > ALPHA:
                continue
            key = (len(members), round(coverage, 3), -p)
            if best is None or key > best[0]:
                fit = PeriodFit(period=p, residue=r, indices=members,
                                coverage=min(1.0, coverage), strays=len(idx) - len(members))
                best = (key, fit)
    if best is None:
        return None
    return best[1] if expected else _coarsen(best[1], n, need)


@dataclass
class SpikeGroup:
    """Outlier steps of one kind, and what they cost beyond a median step."""

    indices: np.ndarray
    excess_s: dict[str, float]  # per breakdown phase: time beyond the median step's phase
    fit: PeriodFit | None

    @property
    def total_excess_s(self) -> float:
        return sum(self.excess_s.values())

    def dominant_phase(self) -> str:
        return max(self.excess_s, key=lambda k: self.excess_s[k])


def stat(stats: Any, key: str = "mean") -> float:
    """One statistic (``mean``, ``median``, ``p90``) of a ``{median, p90, mean}`` summary
    the analysis wrote, 0.0 where it is missing."""
    v = stats.get(key) if isinstance(stats, dict) else None
    return float(v) if isinstance(v, int | float) else 0.0


class Context:
    """The inputs of every rule; derived quantities are computed lazily and cached."""

    def __init__(self, summary: dict[str, Any], steps: np.ndarray | None,
                 device: np.ndarray | None = None) -> None:
        self.summary = summary
        #: the run's CUDA-event time per step (:data:`trainprof.store.DEVICE_DTYPE`), or None
        self.device = device if (
            device is not None and len(device) and device.dtype.names is not None
            and "dev_step_ns" in device.dtype.names) else None
        if steps is None or len(steps) == 0 or steps.dtype.names is None:
            self.steps = np.zeros(0)
        elif "flags" in steps.dtype.names:
            # the steps the summary's statistics are over (warm-up indexes into them): not
            # the cut-off last one, nor those under a heavy tool (--deep, --py, the op sample)
            self.steps = complete_steps(steps)
        else:
            self.steps = steps
        steps_info = summary.get("steps") or {}
        self.warmup = min(int(steps_info.get("warmup") or 0), len(self.steps))
        self._phases: dict[str, np.ndarray] = {}

    # -- summary parts ----------------------------------------------------------------------

    @property
    def breakdown(self) -> dict[str, float]:
        return self.summary.get("breakdown") or {}

    @property
    def step_info(self) -> dict[str, Any]:
        return self.summary.get("steps") or {}

    @property
    def system(self) -> dict[str, Any]:
        return self.summary.get("system") or {}

    @property
    def environment(self) -> dict[str, Any]:
        return self.summary.get("environment") or {}

    @property
    def cores(self) -> int | None:
        cores = self.environment.get("usable_cores")
        return int(cores) if isinstance(cores, int | float) and cores > 0 else None

    @property
    def on_cuda(self) -> bool:
        """The run used a CUDA device (device timings recorded, or a GPU with CUDA torch)."""
        env = self.environment
        return bool(self.summary.get("device")) or bool(env.get("cuda") and env.get("gpu_count"))

    @property
    def script(self) -> str:
        """How the user ran the script (``train.py ARGS`` or ``-m pkg ARGS``), for verify lines.
        Code python read from stdin (``python -``) or a string (``python -c``) has no file to
        run again: its lines name ``SCRIPT.py``, the file to save it in (they had said
        ``trainprof run -``)."""
        cmd = self.summary.get("command")
        if isinstance(cmd, list) and len(cmd) >= 2:
            if str(cmd[1]) in ("-", "-c"):
                return "SCRIPT.py"
            return shlex.join(str(p) for p in cmd[1:])
        return "train.py"

    @property
    def external_cores(self) -> float | None:
        """Cores kept busy by other processes: system CPU minus this run's process and workers."""
        return outside_cores(self.system, self.cores)

    def has_system_samples(self) -> bool:
        return bool(self.system.get("n_samples"))

    @property
    def compute_share(self) -> float:
        """Forward + backward + optimizer share of steady step time."""
        b = self.breakdown
        return sum(float(b.get(k) or 0.0) for k in ("forward", "backward", "optimizer"))

    @cached_property
    def deep_categories(self) -> set[str]:
        """Categories of the last ``--deep`` window's trace findings (the one the report keeps).

        A rule whose cause such a finding already names from the trace (tensor cores
        idle, launch-bound, copies) leaves it to that finding.
        """
        deep = self.summary.get("deep")
        if not isinstance(deep, list):
            return set()
        last = next((d for d in reversed(deep) if isinstance(d, dict) and "findings" in d), None)
        if last is None:
            return set()
        return {str(f.get("category")) for f in last.get("findings") or [] if isinstance(f, dict)}

    @cached_property
    def loaders(self) -> list[dict[str, Any]]:
        return [d for d in self.summary.get("dataloaders") or [] if "error" not in d]

    @cached_property
    def train_loader(self) -> dict[str, Any] | None:
        """The DataLoader that feeds training: the first shuffled one, else the first one seen;
        of several shuffled ones, the one whose loading took the longest.

        Evaluation loaders are usually sequential and created or iterated after the
        training loader, so this picks the training loader in the common layouts. Two
        shuffled loaders zipped in one loop (labelled and unlabelled data) both feed every
        step, and the wait is mostly the slower one's: its fix is the one to give.
        """
        if not self.loaders:
            return None
        shuffled = [d for d in self.loaders
                    if "RandomSampler" in str(d.get("sampler") or "")
                    or "Distributed" in str(d.get("sampler") or "")]
        candidates = shuffled or self.loaders[:1]
        if len(candidates) > 1:
            # several loaders feed each step (zip(labeled, unlabeled)): the one whose
            # loading takes the most time, where every one of them was measured
            costs = [self._loading_seconds(d) for d in candidates]
            if all(c is not None for c in costs):
                return candidates[max(range(len(costs)), key=lambda i: (costs[i], -i))]
        return candidates[0]

    @cached_property
    def loader_groups(self) -> list[list[dict[str, Any]]]:
        """The loaders iterated together, each group in index order: ``iterated_with``.

        The capture notes, of each loader, the others whose iterators were made in the
        same step and still being iterated (``zip(a, b, c)``; capture/hooks.py
        ``LoaderRegistry``): they feed the same steps, their workers run at the same time.
        The relation is closed here (a crashed run's record may name it one way only).
        A step's data wait is the time its ``next()`` calls on all of them took together:
        the record does not split it by loader. A record without ``iterated_with`` (one
        loader, or one written before it) has every loader in a group of its own.
        """
        by_index = {d.get("index"): d for d in self.loaders if isinstance(d.get("index"), int)}
        parent = {i: i for i in by_index}

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for i, d in by_index.items():
            for j in d.get("iterated_with") or []:
                if j in parent:
                    parent[root(j)] = root(i)
        groups: dict[int, list[dict[str, Any]]] = {}
        for i in sorted(by_index):
            groups.setdefault(root(i), []).append(by_index[i])
        return list(groups.values())

    def loaders_alongside(self, loader: dict[str, Any] | None) -> list[dict[str, Any]]:
        """``loader`` and the loaders iterated together with it (its group); [] if none."""
        if not loader:
            return []
        index = loader.get("index")
        return next((g for g in self.loader_groups if any(d.get("index") == index for d in g)),
                    [loader])

    @cached_property
    def concurrent_workers(self) -> int:
        """The most DataLoader worker processes alive at once: of the groups of loaders
        iterated together, the largest sum of their ``num_workers`` (loaders iterated one
        after another never have their workers out together)."""
        return max((sum(int(d.get("num_workers") or 0) for d in g) for g in self.loader_groups),
                   default=0)

    def epoch_batches(self, loader: dict[str, Any] | None) -> int | None:
        """Steps in one epoch of ``loader``'s loop: its own length, or, with loaders zipped
        together, the shortest of theirs (``zip`` stops at the first loader that ends, and
        every loader starts its next epoch there). None when any length is unknown."""
        group = self.loaders_alongside(loader)
        lengths = [self.batches_per_epoch(d) for d in group]
        if not lengths or any(n is None for n in lengths):
            return self.batches_per_epoch(loader)
        return min(n for n in lengths if n is not None)

    def _loading_seconds(self, loader: dict[str, Any]) -> float | None:
        """The time ``loader``'s samples and collates took, as measured where they were
        loaded (the training process, or spread over its workers); None if unmeasured."""
        w = self.worker_stats(loader)
        if not w or not isinstance(w.get("samples"), int | float):
            return None

        total_ms = (float(w["samples"]) * (stat(w.get("sample_cpu_ms"))
                                           + stat(w.get("sample_blocked_ms")))
                    + float(w.get("batches") or 0) * stat(w.get("collate_ms")))
        return total_ms / 1e3 / max(1, int(w.get("num_workers") or 0))

    def batch_tensors(self, loader: dict[str, Any] | None) -> list[dict[str, Any]] | None:
        """The tensors of ``loader``'s first batch (path, dtype, shape), by its index; None
        when not described (capture/padding.py's ``describe_tensors``)."""
        entries = self.summary.get("batch_tensors")
        index = (loader or {}).get("index")
        if not isinstance(entries, list) or not isinstance(index, int):
            return None
        return next((e.get("tensors") for e in entries
                     if isinstance(e, dict) and e.get("loader_index") == index), None)

    @cached_property
    def worker_loaders(self) -> list[dict[str, Any]]:
        """Per DataLoader, what its workers measured (:mod:`trainprof.analysis.workers`)."""
        workers = self.summary.get("workers")
        if not isinstance(workers, dict) or not isinstance(workers.get("loaders"), list):
            return []
        return [e for e in workers["loaders"] if isinstance(e, dict)]

    def worker_stats(self, loader: dict[str, Any] | None) -> dict[str, Any] | None:
        """The worker-side measurements of ``loader`` (by index); of the only loader if unknown."""
        entries = self.worker_loaders
        index = (loader or {}).get("index")
        if isinstance(index, int):
            return next((e for e in entries if e.get("loader_index") == index), None)
        return entries[0] if len(entries) == 1 else None

    @staticmethod
    def batches_per_epoch(loader: dict[str, Any] | None) -> int | None:
        """Batches in one epoch of a map-style loader (``len`` of the DataLoader)."""
        if not loader or loader.get("iterable_dataset"):
            return None
        batches = loader.get("batches")  # len(loader); older records: from len, batch_size
        if isinstance(batches, int) and batches > 0:
            return batches
        n, bs = loader.get("len"), loader.get("batch_size")
        if not isinstance(n, int) or not isinstance(bs, int) or bs <= 0 or n <= 0:
            return None
        return n // bs if loader.get("drop_last") else math.ceil(n / bs)

    # -- steady-state step records ---------------------------------------------------------

    @cached_property
    def steady(self) -> np.ndarray:
        return self.steps[self.warmup :]

    def has_steps(self) -> bool:
        return len(self.steady) > 0 and self.steady.dtype.names is not None

    def seconds(self, column: str) -> np.ndarray:
        return self.steady[column].astype(np.float64) / 1e9

    def steady_share(self, column: str, share: float) -> float:
        """The share of the step of a cost paid alike every step (the optimizer's update,
        zero_grad), robust to a few disturbed steps: the smaller of its time-weighted
        ``share`` (the breakdown's) and its median seconds over the median step.

        Time-weighted shares are the breakdown's definition, and right for costs that come
        in bursts (a full collection, an evaluation); but one optimizer step descheduled
        for 0.8 s by another process made a 2.4 ms update "10.6% of step time" in a 25-step
        run whose median step was 106 ms (2.3%)."""
        if not self.has_steps():
            return share
        median_step = float(np.median(self.durations))
        if median_step <= 0:
            return share
        return min(share, float(np.median(self.seconds(column))) / median_step)

    def phase_seconds(self, phase: str) -> np.ndarray:
        """Seconds per steady step in a breakdown phase (cached: rules share them)."""
        cached = self._phases.get(phase)
        if cached is None:
            cached = sum(self.seconds(c) for c in PHASE_COLUMNS[phase])  # type: ignore[assignment]
            self._phases[phase] = cached
        return cached  # type: ignore[return-value]

    @cached_property
    def durations(self) -> np.ndarray:
        return self.seconds("dur_ns") if self.has_steps() else np.zeros(0)

    @cached_property
    def total_s(self) -> float:
        return float(self.durations.sum())

    @cached_property
    def median_step_s(self) -> float:
        return float(np.median(self.durations)) if len(self.durations) else 0.0

    def step_numbers(self, idx: np.ndarray) -> list[int]:
        """Step numbers (as recorded) of positions in the steady-state steps."""
        return [int(s) for s in self.steady["step"][idx]]

    @cached_property
    def per_iteration(self) -> int | None:
        """Steps an iteration of the loop (a GAN's critic stepped k times a generator
        step: :mod:`trainprof.analysis.iterations`), None where it is one step."""
        k = self.step_info.get("per_iteration")
        return int(k) if isinstance(k, int) and not isinstance(k, bool) and k >= 2 else None

    @cached_property
    def step_kinds(self) -> np.ndarray | None:
        """Each steady step's place in its iteration (its step number modulo
        :attr:`per_iteration`), where an iteration is several steps of different kinds;
        None otherwise. Step numbers, not positions: steps left out under a heavy tool
        do not shift the kinds of the steps after them."""
        k = self.per_iteration
        if k is None or not self.has_steps() or len(self.steady) < 5 * k:
            return None  # too few steps of each kind to judge a step against its own kind
        axis = self._step_axis
        if np.any(np.diff(axis) <= 0):
            axis = np.arange(len(self.steady))
        return axis % k

    @cached_property
    def typical_step_s(self) -> float:
        """A step's usual time: the median step, or where an iteration is k steps of
        different kinds, the mean of each kind's median (an iteration's over k)."""
        kinds = self.step_kinds
        if kinds is None:
            return self.median_step_s
        d = self.durations
        return float(np.mean([np.median(d[kinds == c]) for c in np.unique(kinds)]))

    def _phase_excess(self, idx: np.ndarray, baseline: np.ndarray) -> dict[str, np.ndarray]:
        """Per phase, per step in ``idx``: time beyond the median of the ``baseline`` steps
        (of the step's own kind, where an iteration is steps of different kinds).

        Vectorised: one median per phase (and kind), whatever the number of spikes
        (1M-step runs).
        """
        kinds = self.step_kinds
        out = {}
        for phase in PHASE_COLUMNS:
            col = self.phase_seconds(phase)
            med = float(np.median(col[baseline])) if len(baseline) else 0.0
            if kinds is None or len(idx) == 0:
                out[phase] = np.clip(col[idx] - med, 0, None)
                continue
            expected = np.full(len(col), med)
            for c in np.unique(kinds):
                own = baseline[kinds[baseline] == c]
                if len(own):
                    expected[kinds == c] = float(np.median(col[own]))
            out[phase] = np.clip(col[idx] - expected[idx], 0, None)
        return out

    def _excess(self, idx: np.ndarray, baseline: np.ndarray) -> dict[str, float]:
        """Per phase: total time of the steps ``idx`` beyond the median of ``baseline`` steps."""
        return {k: float(v.sum()) for k, v in self._phase_excess(idx, baseline).items()}

    # -- shared spike analysis -------------------------------------------------------------

    @cached_property
    def _step_axis(self) -> np.ndarray:
        """Each steady step's number minus the first one's: positions with gaps kept.

        Steps under a heavy tool (the op-count sample, ``--deep``, ``--py``) are left
        out of the steady steps, so array positions skip over them; a period is a
        number of *steps*, so outliers are placed by their step numbers.
        """
        numbers = self.steady["step"].astype(np.int64)
        return numbers - numbers[0]

    def _fit_period(self, idx: np.ndarray, expected: int | None = None) -> PeriodFit | None:
        """:func:`fit_period` on the step-number axis, members given back as positions."""
        axis = self._step_axis
        if len(axis) == 0 or np.any(np.diff(axis) <= 0):  # not numbered in order: positions
            axis = np.arange(len(self.steady))
        fit = fit_period(axis[idx], int(axis[-1]) + 1, expected=expected) if len(axis) else None
        if fit is None:
            return None
        return replace(fit, indices=np.searchsorted(axis, fit.indices))

    @cached_property
    def epoch_spikes(self) -> SpikeGroup | None:
        """Data-wait outliers that recur at the training loader's epoch length.

        The first batch of an epoch is where a DataLoader without persistent workers
        starts its worker processes again (data-loading.md §3: 0.13-2.0 s per start
        depending on the start method), so these steps stand out in the data wait.
        Without a known epoch length (iterable datasets), a regular period of at least
        three data-wait spikes is taken instead.
        """
        if not self.has_steps():
            return None
        dw = self.phase_seconds("data_wait")
        idx = outliers_by_kind(dw, max(SPIKE_REL * self.median_step_s, SPIKE_ABS_S),
                               self.step_kinds)
        if len(idx) == 0:
            return None
        bpe = self.epoch_batches(self.train_loader)
        n = len(dw)
        fit = self._fit_period(idx, expected=bpe)
        if fit is None:
            return None
        base = np.setdiff1d(np.arange(n), idx)
        return SpikeGroup(indices=fit.indices, excess_s=self._excess(fit.indices, base), fit=fit)

    @cached_property
    def step_spikes(self) -> np.ndarray:
        """Positions of steady steps whose duration is an outlier (among steps of their
        own kind, where an iteration is several steps: :attr:`step_kinds`; else a GAN's
        generator step, one in k by design, is a spike recurring at period k)."""
        if not self.has_steps():
            return np.zeros(0, dtype=np.int64)
        return outliers_by_kind(self.durations,
                                max(SPIKE_REL * self.median_step_s, SPIKE_ABS_S),
                                self.step_kinds)

    @cached_property
    def device_step_s(self) -> np.ndarray | None:
        """Per steady step, the device's seconds for it (CUDA events, from its first event
        to the next step's: :mod:`trainprof.capture.device_timer`), NaN where none was
        recorded; None for a run without device times."""
        if self.device is None or not self.has_steps():
            return None
        order = np.argsort(self.device["step"], kind="stable")
        recorded = self.device["step"][order]
        steps = self.steady["step"]
        pos = np.clip(np.searchsorted(recorded, steps), 0, len(recorded) - 1)
        found = recorded[pos] == steps
        if not found.any():
            return None
        out = np.full(len(steps), np.nan)
        out[found] = self.device["dev_step_ns"][order][pos[found]].astype(np.float64) / 1e9
        return out

    def _host_caught_up(self, idx: np.ndarray, base: np.ndarray) -> np.ndarray:
        """Which outlier steps at ``idx`` are the host waiting for the device's queued work,
        not work of their own: most of their excess is time blocked in a device sync
        (``sync_ns``: a ``loss.item()`` every 10 steps) while the device's time for the
        step is not an outlier among the ``base`` steps'.

        A host that only launches kernels runs ahead of the device until a read of a
        device tensor makes it wait for everything queued: its logging step is long, the
        others short, and the device works through them all alike. Logging less often
        saves none of that (the device's work is the same); it is the periodic rule's
        false "every 10 steps, periodic work adds ..." on a GPU-bound loop. An evaluation
        on the GPU every N steps makes the device's step long too, and stays periodic."""
        dev = self.device_step_s
        none = np.zeros(len(idx), dtype=bool)
        if dev is None or len(idx) == 0 or "sync_ns" not in (self.steady.dtype.names or ()):
            return none
        typical = dev[base] if len(base) else dev
        typical = typical[np.isfinite(typical)]
        if len(typical) == 0:
            return none
        median_dev = float(np.median(typical))
        limit = median_dev + max(SPIKE_REL * median_dev, SPIKE_ABS_S)
        excess = self.durations[idx] - self.median_step_s
        blocked = self.steady["sync_ns"][idx].astype(np.float64) / 1e9
        with np.errstate(invalid="ignore"):
            return (blocked >= 0.5 * excess) & np.isfinite(dev[idx]) & (dev[idx] <= limit)

    @cached_property
    def spike_groups(self) -> dict[str, SpikeGroup]:
        """Outlier steps by owner: ``epoch``, ``input``, ``gc``, ``device_wait``,
        ``periodic``, ``stray``.

        ``device_wait``: steps whose excess is the host waiting in a device sync for work
        the device did at its usual pace (:meth:`_host_caught_up`): no step's own work.

        An outlier step belongs to ``gc`` when garbage collection is most of its excess
        time, to ``epoch`` when it is one of :attr:`epoch_spikes`; of the others, those
        that recur at a fixed period (evaluation, checkpointing, logging every N steps)
        are ``periodic`` (with their :class:`PeriodFit`) and the rest ``stray`` - except
        that a period whose excess is almost all data wait (:data:`DATA_OWNED`) is the
        input pipeline's (``input``): workers that cannot keep up deliver in turns, so
        the loop waits every ``num_workers`` steps, which is not work of the script's
        own every N steps (an evaluation shows in forward too) - unless those steps took
        in other batches besides the training one (:meth:`_fetch_extra_batches`): then
        the wait is an evaluation loader's, most of an evaluation pass whose loader
        starts its workers each time (trainval.py: 2.2 s of data wait, 0.27 s forward).
        """
        idx = self.step_spikes
        if len(idx) == 0:
            return {}
        base = np.setdiff1d(np.arange(len(self.durations)), idx)
        per_phase = self._phase_excess(idx, base)
        total = sum(per_phase.values())
        is_gc = (total > 0) & (per_phase["gc"] >= 0.5 * total)
        epoch = np.zeros(0, dtype=np.int64) if self.epoch_spikes is None else (
            self.epoch_spikes.indices
        )
        is_wait = ~is_gc & self._host_caught_up(idx, base)
        is_epoch = ~is_gc & ~is_wait & np.isin(idx, epoch)
        rest = ~is_gc & ~is_wait & ~is_epoch
        fit = (self._fit_period(idx[rest]) if rest.sum() >= 3 else None) or (
            self._fit_by_phase(idx[rest], {k: v[rest] for k, v in per_phase.items()})
        ) or self._fit_by_magnitude(idx[rest], total[rest])
        is_periodic = np.isin(idx, fit.indices) if fit is not None else np.zeros_like(rest)
        is_input = np.zeros_like(rest)
        if fit is not None and not self._fetch_extra_batches(idx[is_periodic]):
            periodic_total = float(total[is_periodic].sum())
            if periodic_total > 0 and (
                float(per_phase["data_wait"][is_periodic].sum()) >= DATA_OWNED * periodic_total
            ):
                is_input, is_periodic = is_periodic, np.zeros_like(rest)
        masks = {"gc": is_gc, "device_wait": is_wait, "epoch": is_epoch, "input": is_input,
                 "periodic": is_periodic, "stray": rest & ~is_periodic & ~is_input}
        out = {}
        for name, mask in masks.items():
            if not mask.any():
                continue
            out[name] = SpikeGroup(
                indices=idx[mask],
                excess_s={k: float(v[mask].sum()) for k, v in per_phase.items()},
                fit=fit if name in ("periodic", "input") else None,
            )
        return out

    def _fetch_extra_batches(self, idx: np.ndarray) -> bool:
        """Do the steady steps at ``idx`` take in other batches besides their training
        batch (their median sample count at least :data:`EXTRA_BATCHES` times a median
        step's)? Then their data wait is another loader's, iterated inside the step (an
        evaluation every N steps), which is periodic work of the script's own: not the
        input pipeline's, whose late deliveries bring one batch a step like any other."""
        if len(idx) == 0 or "samples" not in (self.steady.dtype.names or ()):
            return False
        samples = self.steady["samples"].astype(np.float64)
        typical = float(np.median(samples))
        return typical > 0 and float(np.median(samples[idx])) >= EXTRA_BATCHES * typical

    def _fit_by_phase(self, idx: np.ndarray, excess: dict[str, np.ndarray]
                      ) -> PeriodFit | None:
        """A period among the outliers whose excess is mostly one phase's, when all of
        them together have none: the best-filled fit of any phase (by its members' excess).

        Outside load stalls the phases the step spends its time in (forward and
        backward, on a busy machine sometimes for a second and more), while work done
        every N steps has a phase of its own: a checkpoint or a log is "other", an
        evaluation forward. Bursts of load larger than a checkpoint hid its period from
        the fit by magnitude (a nanoGPT-like run saving every 5 steps on a shared 2-core
        machine: no finding; grouped by phase, period 5)."""
        if len(idx) < 3 or not excess:
            return None
        phases = list(excess)
        stacked = np.vstack([excess[k] for k in phases])
        dominant = stacked.argmax(axis=0)
        best, best_excess = None, 0.0
        for i in range(len(phases)):
            members = dominant == i
            if members.sum() < 3:
                continue
            fit = self._fit_period(idx[members])
            if fit is None:
                continue
            mass = float(stacked[:, members].sum())
            if mass > best_excess:
                best, best_excess = fit, mass
        return best

    def _fit_by_magnitude(self, idx: np.ndarray, excess: np.ndarray) -> PeriodFit | None:
        """A period among the outliers, trying the larger ones alone when all of them fail.

        On a busy machine a third of the steps can be outliers (a descheduled thread
        stalls the step), which drowns a real period in strays; work done every N
        steps (an evaluation) is usually much larger than such stalls, so the outliers
        above the median outlier excess are tried next, and so on while 3 remain.
        """
        while len(idx) >= 3:
            fit = self._fit_period(idx)
            if fit is not None:
                return fit
            keep = excess > np.median(excess)
            if keep.all() or not keep.any():
                return None
            idx, excess = idx[keep], excess[keep]
        return None

    @cached_property
    def periodic(self) -> SpikeGroup | None:
        """The non-epoch, non-GC outlier steps that recur at a fixed period, if any."""
        return self.spike_groups.get("periodic")
