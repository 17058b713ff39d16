"""A job resumed on another world size goes on where the saved run's data stood (DataCursor's origin)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from undying.errors import UsageError
from undying.worker.data import DataCursor, map_position

N, BATCH = 96, 4  # 4 ranks: 6 batches an epoch; 2 ranks: 12; 3 ranks: 8


def dataset() -> TensorDataset:
    return TensorDataset(torch.arange(N).unsqueeze(1))


def loader(world: int, rank: int) -> DataLoader:
    data = dataset()
    return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, num_replicas=world, rank=rank, seed=3))


def read_by_job(world: int, cursors: list[DataCursor], steps: range) -> set[int]:
    return {int(i) for c in cursors for s in steps for i in c.batch_for(s)[0].flatten()}


def test_map_position_keeps_whole_epochs_and_the_fraction_read() -> None:
    assert map_position(0, 6, 12) == 0
    assert map_position(5, 6, 12) == 10  # 4 ranks -> 2: twice the batches per rank
    assert map_position(6, 6, 12) == 12  # an epoch boundary stays one
    assert map_position(13, 6, 12) == 26
    assert map_position(10, 12, 6) == 5  # 2 ranks -> 4
    assert map_position(7, 8, 8) == 7  # same size: unchanged
    assert map_position(5, 6, 8) == 6  # 4 -> 3 ranks: 20/24 of the epoch read, 6 of 8 batches (rounded down)
    with pytest.raises(UsageError, match="steps per epoch"):
        map_position(3, 0, 8)


@pytest.mark.parametrize("saved_steps", [3, 6, 8, 11])
def test_two_ranks_read_exactly_the_samples_four_ranks_had_not(saved_steps: int) -> None:
    """Samples of the interrupted epoch read before the save plus those after the resume: each once."""
    before = [DataCursor(loader(4, r), rank=r, seed=0, total=None, epochs=2) for r in range(4)]
    spe4 = 6
    epoch_start = (saved_steps // spe4) * spe4
    read_before = read_by_job(4, before, range(epoch_start + 1, saved_steps + 1))
    position = map_position(saved_steps, spe4, 12)
    after = [DataCursor(loader(2, r), rank=r, seed=0, total=None, epochs=2, origin=(saved_steps, position))
             for r in range(2)]
    assert after[0].total_steps == saved_steps + 2 * 12 - position
    epoch_end = saved_steps + (12 - position % 12)
    read_after = read_by_job(2, after, range(saved_steps + 1, epoch_end + 1))
    assert read_before.isdisjoint(read_after)
    assert read_before | read_after == set(range(N))
    assert after[0].epoch_of(saved_steps + 1) == saved_steps // spe4


def test_an_origin_set_after_the_first_batch_moves_the_cursor() -> None:
    cursor = DataCursor(loader(2, 0), rank=0, seed=0, total=None, epochs=1)
    first = cursor.batch_for(1)
    assert cursor.total_steps == 12
    cursor.set_origin((20, 2))  # step 20 read the 2nd batch of the epoch
    assert cursor.total_steps == 30 and cursor.position(21) == 3
    fresh = DataCursor(loader(2, 0), rank=0, seed=0, total=None, epochs=1)
    assert torch.equal(cursor.batch_for(21)[0], fresh.batch_for(3)[0])
    assert not torch.equal(cursor.batch_for(21)[0], first[0])


def test_total_counts_steps_whatever_the_origin() -> None:
    cursor = DataCursor(loader(2, 0), rank=0, seed=0, total=50, epochs=None, origin=(20, 40))
    assert cursor.total_steps == 50
    assert cursor.epoch_of(21) == 3  # batch 41 of 12 an epoch
