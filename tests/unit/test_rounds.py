"""node/replica/rounds.py's RoundRunner, driven in-process: two DiLoCo members over the in-memory transport
(the DHT rendezvous replaced by a fixed group), each with its own runner on one event-loop thread.

``--overlap-mode eager``: the first round has no estimate; it keeps the other member's Σ n_j·Δ_j; the next
round's start steps θ at once to the outer step of Δ̃ = (n_i·Δ_i + n_o·Δ_o(previous)) / Σn, φ and the
outer momentum untouched, and the round's true result differs from that estimate by exactly what the
other member's Δ changed. Values are checked against a hand-written Nesterov step, not the outer's code.
"""

from __future__ import annotations

import pytest
import torch

from gossip.outer import NesterovOuter
from tests.helpers.diloco_members import diloco_members
from tests.helpers.memory_transport import Network
from tests.helpers.round_runners import with_runners

SHAPES = [(24, 16), (16,), (7, 5)]
LR, MU = 0.7, 0.9


@pytest.fixture
def pair(monkeypatch):
    """Two members (samples 8 and 16, outer η 0.7, Nesterov μ 0.9), each with an eager RoundRunner."""
    network = Network()
    phi0, members = diloco_members(2, network, SHAPES, "none", part_numel=64, seed=11, fetch_timeout=10, serve_timeout=10)
    for m in members:
        m["averager"].outer = NesterovOuter(lr=LR, momentum=MU)
        m["averager"].keep_others = True
    net = with_runners(monkeypatch, members, eager=True)
    yield phi0, members
    net.close()


def _params(tensors):
    return [torch.nn.Parameter(t.clone()) for t in tensors]


def _run(members, round_no, thetas):
    """Start round ``round_no`` on both members (θ = ``thetas[k]``); returns (the params right after
    ``start``, the pending rounds, the results)."""
    indices = list(range(len(SHAPES)))
    params, pendings = [], []
    for m, theta in zip(members, thetas):
        p = _params(theta)
        pendings.append(m["runner"].start(round_no, 0, indices, m["phi"], p, m["samples"], 10, None))
        params.append([t.detach().clone() for t in p])
    results = [m["runner"].wait() for m in members]
    assert all(r is not None and r[0].in_sync and len(r[0].contributors) == 2 for r in results), results
    return params, pendings, [r[0] for r in results]


def _close(a, b):
    return all(torch.allclose(x, y, atol=1e-5, rtol=1e-5) for x, y in zip(a, b))


def test_eager_steps_with_an_estimate_then_the_true_average_corrects_it(pair):
    phi0, members = pair
    n = [m["samples"] for m in members]
    total = sum(n)
    d0 = [m["delta"] for m in members]

    # round 0: nothing to estimate from yet; each member keeps the other's n·Δ
    params, pendings, results = _run(members, 0, [m["theta"] for m in members])
    assert all(p.eager is None for p in pendings)
    for k, m in enumerate(members):
        assert all(torch.equal(a, t) for a, t in zip(params[k], m["theta"])), "no estimate in the first round: θ untouched"
        others_sum, others_samples = m["runner"].others_prev[0]
        assert others_samples == n[1 - k]
        assert _close(others_sum, [n[1 - k] * d for d in d0[1 - k]])
    mean0 = [(n[0] * a + n[1] * b) / total for a, b in zip(*d0)]
    v0 = mean0
    phi1 = [p - LR * (d + MU * v) for p, d, v in zip(phi0, mean0, v0)]  # Nesterov: v = Δ, φ -= η(Δ + μv)
    for m in members:
        assert _close(m["phi"], phi1)
    assert all(torch.equal(a, b) for a, b in zip(members[0]["phi"], members[1]["phi"])), "replicas differ"

    # round 1: fresh Δ'; the start steps θ at once to the estimate, φ and the momentum untouched
    g = torch.Generator().manual_seed(5)
    d1 = [[torch.randn(s, generator=g) for s in SHAPES] for _ in members]
    momentum_before = [[b.clone() for b in m["averager"].outer.state_tensors(m["phi"])] for m in members]
    thetas = [[p - d for p, d in zip(phi1, d1[k])] for k in range(2)]
    indices = list(range(len(SHAPES)))
    estimates, started = [], []
    for k, m in enumerate(members):
        p = _params(thetas[k])
        started.append(m["runner"].start(1, 0, indices, m["phi"], p, m["samples"], 10, None))
        params_now = [t.detach().clone() for t in p]
        guess_delta = [(n[k] * mine + n[1 - k] * theirs) / total for mine, theirs in zip(d1[k], d0[1 - k])]
        v = [MU * a + b for a, b in zip(v0, guess_delta)]
        estimate = [p_ - LR * (d + MU * v_) for p_, d, v_ in zip(phi1, guess_delta, v)]
        assert _close(params_now, estimate), "θ must step at once to the estimate's outer step"
        assert _close(started[k].eager, estimate), "the pending round remembers the estimate it applied"
        estimates.append(estimate)
    results = [m["runner"].wait() for m in members]
    assert all(r is not None and r[0].in_sync and len(r[0].contributors) == 2 for r in results)
    # the estimate left φ and the momentum alone: the round's true step starts from them
    mean1 = [(n[0] * a + n[1] * b) / total for a, b in zip(*d1)]
    v1 = [MU * a + b for a, b in zip(v0, mean1)]
    phi2 = [p - LR * (d + MU * v) for p, d, v in zip(phi1, mean1, v1)]
    for k, m in enumerate(members):
        assert _close(m["phi"], phi2), "the true average, stepped from the momentum as it was before the estimate"
        # what the node adds to θ when the result arrives (φ − estimate): the others' change of Δ, weighted
        correction = [a - b for a, b in zip(m["phi"], estimates[k])]
        dv = [n[1 - k] * (new - old) / total for new, old in zip(d1[1 - k], d0[1 - k])]
        expected = [-LR * (1 + MU) * x for x in dv]
        assert _close(correction, expected)
        assert not _close(correction, [torch.zeros_like(c) for c in correction]), "the estimate was off: a real correction"
        assert _close(momentum_before[k], v0)


def test_without_eager_the_start_leaves_theta_alone(pair):
    _, members = pair
    for m in members:
        m["runner"].eager = False
    _run(members, 0, [m["theta"] for m in members])
    params, pendings, _ = _run(members, 1, [m["theta"] for m in members])
    assert all(p.eager is None for p in pendings)
    for k, m in enumerate(members):
        assert all(torch.equal(a, t) for a, t in zip(params[k], m["theta"]))


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_an_overlapped_round_keeps_the_steps_taken_beside_it(alpha):
    """θ ← θ + (1−α)(φ − θ_start): with no step in between it is the plain merge (1−α)φ + αθ; steps taken
    while the round ran stay on top of the agreed φ."""
    from gossip.fragments import merge_fragment

    g = torch.Generator().manual_seed(0)
    start, phi, steps = (torch.randn(3, 4, generator=g) for _ in range(3))
    unchanged, merged = start.clone(), start.clone()
    merge_fragment([unchanged], [phi], alpha, start=[start])
    merge_fragment([merged], [phi], alpha)
    torch.testing.assert_close(unchanged, merged)
    moved = start + steps
    merge_fragment([moved], [phi], alpha, start=[start])
    torch.testing.assert_close(moved, (1 - alpha) * phi + alpha * start + steps)

