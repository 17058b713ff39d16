"""Random state derived from (seed, rank, purpose, number)."""

from __future__ import annotations

import hashlib
import itertools
import random

import numpy as np
import torch

from undying.worker.rng import derived_seed, reseed


def test_derived_seed_is_a_pure_function_of_its_inputs() -> None:
    # Independent of the process (no hash(), no PYTHONHASHSEED): a replacement
    # process computes the same value as the rank it replaces.
    expected = int.from_bytes(hashlib.blake2b(b"7/3/data/12", digest_size=8).digest(), "little") & (2**63 - 1)
    assert derived_seed(7, 3, "data", 12) == expected
    assert derived_seed(7, 3, "data", 12) == derived_seed(7, 3, "data", 12)


def test_derived_seeds_differ_across_every_input() -> None:
    seen: dict[int, tuple[object, ...]] = {}
    for key in itertools.product((0, 1, 12345), range(8), ("body", "data", "epoch"), range(40)):
        value = derived_seed(*key)
        assert 0 <= value < 2**63  # a valid torch.manual_seed argument
        assert value not in seen, (key, seen.get(value))
        seen[value] = key


def test_fields_do_not_run_into_each_other() -> None:
    assert derived_seed(1, 23, "data", 4) != derived_seed(12, 3, "data", 4)
    assert derived_seed(1, 2, "data", 34) != derived_seed(1, 23, "data", 4)
    assert derived_seed(0, 0, "body", 1) != derived_seed(0, 0, "body", -1)


def _draws() -> tuple[torch.Tensor, float, np.ndarray]:
    return torch.rand(5), random.random(), np.random.rand(3)


def test_reseed_repeats_torch_random_and_numpy() -> None:
    reseed(5, 1, "body", 9)
    t1, r1, n1 = _draws()
    _draws()  # the streams move on
    reseed(5, 1, "body", 9)
    t2, r2, n2 = _draws()
    assert torch.equal(t1, t2)
    assert r1 == r2
    assert np.array_equal(n1, n2)


def test_reseed_for_another_step_or_rank_draws_other_numbers() -> None:
    reseed(5, 1, "body", 9)
    base = _draws()
    for args in ((5, 1, "body", 10), (5, 2, "body", 9), (5, 1, "data", 9), (6, 1, "body", 9)):
        reseed(*args)
        t, r, n = _draws()
        assert not torch.equal(t, base[0]) and r != base[1] and not np.array_equal(n, base[2]), args


def test_reseed_seeds_torch_with_the_derived_seed() -> None:
    reseed(3, 0, "epoch", 2)
    assert torch.initial_seed() == derived_seed(3, 0, "epoch", 2)
