"""Periodic work in a loop whose iteration is several steps (a WGAN's critic stepped k times
a generator step): the generator's step, long once an iteration by design, is the algorithm,
not work every k steps; work every N iterations is still found, at its period in steps."""

from __future__ import annotations

from conftest import trainprof, write_script

from trainprof.diagnosis.periodic import fmt_s

GAN = """
    import sys, time
    import torch
    from torch import nn

    K, PAUSE_EVERY = 3, int(sys.argv[1])
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                      nn.Linear(256, 128))
    D = nn.Sequential(nn.Linear(128, 256), nn.LeakyReLU(0.2), nn.Linear(256, 1))
    og = torch.optim.Adam(G.parameters(), lr=1e-4)
    od = torch.optim.Adam(D.parameters(), lr=1e-4)
    real = torch.randn(4096, 128)
    for it in range(120):
        for _ in range(K):
            x = real[torch.randint(0, 4096, (64,))]
            ld = D(G(torch.randn(64, 64)).detach()).mean() - D(x).mean()
            od.zero_grad(); ld.backward(); od.step()
        lg = -D(G(torch.randn(64, 64))).mean()
        og.zero_grad(); lg.backward(); og.step()
        if PAUSE_EVERY and it % PAUSE_EVERY == PAUSE_EVERY - 1:
            time.sleep(0.05)  # a checkpoint every PAUSE_EVERY iterations
"""


def _periodic(tmp_path, pause_every: int) -> tuple[dict, list[dict]]:
    write_script(tmp_path, "gan.py", GAN)
    res = trainprof("run", "--json", "--no-html", "gan.py", str(pause_every), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = res.json()
    return doc, [f for f in doc["findings"] if f["category"] == "periodic_overhead"]


def test_a_gan_generator_step_every_k_steps_is_not_periodic_work(tmp_path):
    doc, periodic = _periodic(tmp_path, 0)
    assert doc["steps"]["per_iteration"] == 3
    assert periodic == [], periodic  # was "[high] Every 3 steps, periodic work ... 32%"


def test_a_gan_with_a_pause_every_20_iterations_gets_it_at_60_steps(tmp_path):
    doc, periodic = _periodic(tmp_path, 20)
    assert doc["steps"]["per_iteration"] == 3
    assert len(periodic) == 1, doc["findings"]
    f = periodic[0]
    ev = f["evidence"]
    assert ev["period_steps"] == 60 and ev["steps_per_iteration"] == 3
    assert f["title"].startswith("Every 60 steps (20 iterations of 3 steps)")
    # each occurrence costs the 50 ms sleep beyond a step of its kind
    assert 0.045 < ev["excess_per_occurrence_s"] < 0.08
    # the title's figure is the evidence's, which the JSON keeps to 4 significant digits
    # (0.05065 s, where the title had rounded 0.050651 to "50.7 ms")
    per_occ = ev["excess_per_occurrence_s"]
    assert any(fmt_s(per_occ + d) in f["title"] for d in (-5e-5, 0.0, 5e-5)), f["title"]


def test_periodic_costs_print_in_the_unit_they_are_in():
    assert fmt_s(0.0021) == "2.1 ms" and fmt_s(2.5) == "2.50 s" and fmt_s(4e-4) == "400 µs"
