"""The tail's token choice: greedy picks the first maximum, seeded draws replay."""
import torch

from fabric.compute.sampling import draw, sample
from fabric.wire.protocol import Sampling

GREEDY = Sampling()


def test_greedy_is_torch_argmax_for_every_row_of_a_batch():
    torch.manual_seed(0)
    logits = torch.randn(8, 49152)  # the tail hands sample() rows of its batch: views, not copies
    assert [sample(row, GREEDY, 5) for row in logits] == logits.argmax(-1).tolist()


def test_greedy_ties_go_to_the_first_maximum_in_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.zeros(100, dtype=dtype)
        logits[[17, 42, 99]] = 3.0
        assert sample(logits, GREEDY, 0) == 17 == int(torch.argmax(logits)), dtype


def test_seeded_draws_replay_and_narrow_to_greedy():
    torch.manual_seed(1)
    logits = torch.randn(1000)
    hot = Sampling(temperature=1.0, seed=7)
    assert [sample(logits, hot, p) for p in range(20)] == [sample(logits.clone(), hot, p) for p in range(20)]
    assert len({sample(logits, hot, p) for p in range(50)}) > 1  # the draws do differ by position
    assert draw(7, 3) == draw(7, 3) != draw(8, 3)
    best = int(torch.argmax(logits))
    assert sample(logits, Sampling(temperature=1.0, top_k=1, seed=3), 9) == best
    assert sample(logits, Sampling(temperature=1.0, top_p=1e-6, seed=3), 9) == best
