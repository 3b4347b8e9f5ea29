"""Error feedback on the codec level: the SparseLoCo identity and bounded residuals."""

from __future__ import annotations

import pytest
import torch

from compression import ErrorFeedback, Payload, get_codec


@pytest.mark.parametrize("shape", [(130, 70), (4096 * 2 + 3,), (3, 4, 5), ()])
def test_sparseloco_full_k_no_quantization_zero_decay_is_the_identity(shape: tuple[int, ...]) -> None:
    """k = C, no quantization, β = 0: every peer's decoded update equals its pseudo-gradient exactly,
    so φ − η·mean_i(decode_i) is DiLoCo's outer step with plain SGD (lr η, no momentum)."""
    codec = get_codec("topk:4096/4096")
    g = torch.Generator().manual_seed(0)
    states = [ErrorFeedback(decay=0.0) for _ in range(3)]
    phi = torch.randn(shape, generator=g)
    eta = 0.7
    for _ in range(4):
        deltas = [torch.randn(shape, generator=g) for _ in states]
        decoded = [
            codec.decode(Payload.from_bytes(codec.encode(d, state=ef).to_bytes())) for d, ef in zip(deltas, states)
        ]
        for d, out, ef in zip(deltas, decoded, states):
            assert torch.equal(out, d)
            assert ef.norm() == 0.0
        outer_sparseloco = phi - eta * torch.stack(decoded).mean(0)
        outer_diloco_sgd = phi - eta * torch.stack(deltas).mean(0)
        assert torch.equal(outer_sparseloco, outer_diloco_sgd)
        phi = outer_sparseloco


def test_error_feedback_update_rule() -> None:
    codec, ef = get_codec("topk:1/4"), ErrorFeedback(decay=0.5)
    first = torch.tensor([1.0, -3.0, 2.0, 0.5])
    assert codec.decode(codec.encode(first, state=ef)).tolist() == [0.0, -3.0, 0.0, 0.0]
    assert ef.residual.tolist() == [1.0, 0.0, 2.0, 0.5]
    second = torch.tensor([0.0, 0.0, 0.0, 1.0])
    # e' = 0.5·[1, 0, 2, 0.5] + [0, 0, 0, 1] = [0.5, 0, 1, 1.25]: the largest, 1.25, is sent
    assert codec.decode(codec.encode(second, state=ef)).tolist() == [0.0, 0.0, 0.0, 1.25]
    assert ef.residual.tolist() == [0.5, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("spec", ["topk:64/4096+q2", "topk:64/4096", "dct:32/4096+q2", "q2", "int8-block"])
def test_residual_stays_bounded_over_200_rounds(spec: str) -> None:
    """With β = 1 the residual is exactly Σ inputs − Σ decoded. Without feedback that gap would grow
    like √T·‖g‖ (≈ 1810 here at T = 200); with it, it levels off: the last 100 rounds never exceed the
    first 100 by more than 25 %, and stay far below the random-walk growth."""
    codec, ef = get_codec(spec), ErrorFeedback(decay=1.0)
    g = torch.Generator().manual_seed(1)
    sent, received, gaps = torch.zeros(128, 128), torch.zeros(128, 128), []
    for _ in range(200):
        x = torch.randn(128, 128, generator=g)
        sent += x
        received += codec.decode(codec.encode(x, state=ef))
        gaps.append(float((sent - received).norm()))
        assert abs(gaps[-1] - ef.norm()) <= 1e-3 * (1 + gaps[-1])
    assert max(gaps[100:]) <= 1.25 * max(gaps[:100])
    assert max(gaps) <= 0.5 * 200**0.5 * 128


def test_decayed_residual_is_bounded_by_the_geometric_series() -> None:
    codec, ef = get_codec("topk:64/4096+q2"), ErrorFeedback(decay=0.95)
    g = torch.Generator().manual_seed(2)
    for _ in range(200):
        codec.encode(torch.randn(64, 64, generator=g), state=ef)
        # ‖e‖ ≤ Σ_t 0.95^t·‖g‖·(1 + ‖Q error‖/‖g‖) ≤ 20·‖g‖·2
        assert ef.norm() <= 40 * 64


def test_error_feedback_checks_its_inputs() -> None:
    with pytest.raises(ValueError):
        ErrorFeedback(decay=1.5)
    codec, ef = get_codec("q8"), ErrorFeedback(decay=0.9)
    codec.encode(torch.randn(10), state=ef)
    with pytest.raises(ValueError, match="one ErrorFeedback per tensor"):
        codec.encode(torch.randn(11), state=ef)
    ef.reset()
    assert ef.norm() == 0.0
    codec.encode(torch.randn(11), state=ef)


def test_residuals_survive_a_checkpoint_and_wrong_ones_are_refused_by_name():
    from compression import feedback_state, load_feedback_state

    shapes = [(3,), (2, 2)]
    buffers = [ErrorFeedback(0.9) for _ in shapes]
    buffers[0].commit(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.0, 0.0]))
    saved = feedback_state(buffers)
    assert saved is not None and saved[1] is None and torch.equal(saved[0], torch.tensor([0.0, 2.0, 3.0]))
    buffers[0].residual.zero_()  # the copy does not share the buffer's memory
    assert torch.equal(saved[0], torch.tensor([0.0, 2.0, 3.0]))

    restored = [ErrorFeedback(0.9) for _ in shapes]
    restored[1].commit(torch.ones(2, 2), torch.zeros(2, 2))  # a stale residual is dropped, not kept
    assert load_feedback_state(restored, saved, shapes) is None
    assert torch.equal(restored[0].residual, saved[0]) and restored[1].residual is None
    assert feedback_state(None) is None

    fresh = [ErrorFeedback(0.9) for _ in shapes]
    assert load_feedback_state(fresh, None, shapes) == "the checkpoint holds no error-feedback buffers"
    assert "holds 1 error-feedback buffers, this run has 2" in load_feedback_state(fresh, saved[:1], shapes)
    wrong = load_feedback_state(fresh, [torch.zeros(4), None], shapes)
    assert wrong == "error-feedback buffer 0 holds [4], this run's part has shape [3]"
    assert "holds str" in load_feedback_state(fresh, ["x", None], shapes)
    assert all(b.residual is None for b in fresh), "a refused state leaves the buffers empty"
