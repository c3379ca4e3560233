"""CUDA-event phase timing, with fake events on CPU (the real path runs on a GPU machine)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import trainprof
from trainprof.capture import device_timer as dt
from trainprof.capture.device_timer import DeviceTimer
from trainprof.store import load_run


class FakeDevice:
    """A device clock the test moves by hand; events complete when the device reaches them."""

    def __init__(self) -> None:
        self.now_ns = 0  # where the host enqueues
        self.done_ns = 0  # how far the device has executed
        self.created = 0

    def event(self) -> FakeEvent:
        self.created += 1
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, dev: FakeDevice) -> None:
        self.dev = dev
        self.t: int | None = None

    def record(self) -> None:
        self.t = self.dev.now_ns

    def query(self) -> bool:
        return self.t is not None and self.t <= self.dev.done_ns

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an unfinished event would sync"
        return (end.t - self.t) / 1e6  # milliseconds, like torch.cuda.Event


def _step(timer: DeviceTimer, dev: FakeDevice, step: int, fwd: int, bwd: int, opt: int,
          gap: int) -> None:
    dev.now_ns += gap
    timer.mark(dt.FWD_BEGIN)
    dev.now_ns += fwd
    timer.mark(dt.FWD_END)
    timer.mark(dt.BWD_BEGIN)
    dev.now_ns += bwd
    timer.mark(dt.BWD_END)
    timer.mark(dt.OPT_BEGIN)
    dev.now_ns += opt
    timer.mark(dt.OPT_END)
    timer.step_closed(step)


def test_spans_are_exact_and_resolution_never_waits():
    dev = FakeDevice()
    timer = DeviceTimer(dev.event)
    for step in range(10):
        _step(timer, dev, step, fwd=3_000_000, bwd=5_000_000, opt=1_000_000, gap=2_000_000)
    assert not timer.records  # the device has run nothing yet: nothing is resolved
    dev.done_ns = dev.now_ns
    timer.resolve()
    recs = list(timer.records)
    assert [r[0] for r in recs] == list(range(1, 10))  # step 0 has no start marker
    for _, dev_step, fwd, bwd, opt, gap in recs:
        assert (dev_step, fwd, bwd, opt, gap) == (11_000_000, 3_000_000, 5_000_000, 1_000_000,
                                                  2_000_000)
    # events are recycled: steady state needs a bounded pool, not 8 new events per step
    created = dev.created
    for step in range(10, 200):
        _step(timer, dev, step, 1, 1, 1, 1)
        dev.done_ns = dev.now_ns
    assert dev.created - created < 20


def test_device_far_behind_skips_instead_of_piling_up():
    dev = FakeDevice()
    timer = DeviceTimer(dev.event)
    for step in range(300):
        _step(timer, dev, step, 10, 10, 10, 10)
    assert len(timer._pending) <= dt.MAX_PENDING
    assert timer.skipped > 0
    assert dev.created < 10 * dt.MAX_PENDING


def test_device_records_reach_the_run_and_summary(tmp_path):
    dev = FakeDevice()
    with trainprof.profile(tmp_path / "r", report=False) as prof:
        prof._recorder.clock.device = DeviceTimer(dev.event)

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(4, 1)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                dev.now_ns += 4_000_000  # the forward "kernels" take 4 ms on the device
                return self.lin(x)

        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(20):
            dev.now_ns += 1_000_000  # 1 ms of device time outside phases
            loss = model(torch.randn(2, 4)).sum()
            loss.backward()
            opt.step()
            dev.done_ns = dev.now_ns
            time.sleep(0.001)
    device = load_run(tmp_path / "r").device
    assert len(device) >= 15
    s = prof.summary["device"]
    assert s["median_step_s"] == pytest.approx(0.005)
    assert s["breakdown"]["forward"] == pytest.approx(0.8, abs=1e-6)
    assert s["breakdown"]["gap"] == pytest.approx(0.2, abs=1e-6)


def test_an_optimizer_closure_does_not_nest_device_spans(tmp_path):
    """``opt.step(closure)``: the forward and backward run inside the optimizer step.
    The optimizer's device span is closed around the closure, so the spans add up to
    the step and the time outside them (the gap) stays what it is."""
    dev = FakeDevice()

    class SlowGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            dev.now_ns += 2_000_000  # the backward "kernels": 2 ms
            return g

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dev.now_ns += 4_000_000  # the forward: 4 ms
            return self.lin(x)

    class Opt(torch.optim.SGD):
        def step(self, closure=None):  # noqa: ANN001, ANN202
            dev.now_ns += 300_000  # the optimizer's own work: 0.3 ms before the closure
            loss = closure()
            super().step()
            dev.now_ns += 200_000  # and 0.2 ms after
            return loss

    with trainprof.profile(tmp_path / "r", report=False) as prof:
        prof._recorder.clock.device = DeviceTimer(dev.event)
        model = Net()
        opt = Opt(model.parameters(), lr=0.1)
        for _ in range(20):
            dev.now_ns += 1_000_000  # 1 ms outside the phases

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = SlowGrad.apply(model(torch.randn(2, 4))).sum()
                loss.backward()
                return loss

            opt.step(closure)
            dev.done_ns = dev.now_ns
    s = prof.summary["device"]
    assert s["median_step_s"] == pytest.approx(0.0075)
    b = s["breakdown"]
    assert b["forward"] == pytest.approx(4 / 7.5, abs=1e-6)
    assert b["backward"] == pytest.approx(2 / 7.5, abs=1e-6)
    assert b["optimizer"] == pytest.approx(0.5 / 7.5, abs=1e-6)
    assert b["gap"] == pytest.approx(1 / 7.5, abs=1e-6)
