"""Invariant mode's parts in one process: the layout, the fixed-order fold, a virtual rank's data and random
stream, and the errors. The multi-process proof (1, 2, 3, 4 ranks, a crash, shrink and grow) is
tests/integration/test_invariant.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from undying.cli.main import main
from undying.demo.shrink import check_incidents, refuse
from undying.errors import UsageError
from undying.protocol.env import VIRTUAL_RANKS_ENV
from undying.worker import rng
from undying.worker.job import Job
from undying.worker.state import State
from undying.worker.virtual import fold, layout, virtual_ranks_from_env


@pytest.mark.parametrize(("virtual", "world"), [(4, 1), (4, 2), (4, 3), (4, 4), (7, 3), (16, 5)])
def test_the_layout_gives_every_virtual_rank_once_in_contiguous_blocks(virtual: int, world: int) -> None:
    blocks = layout(virtual, world)
    assert len(blocks) == world
    assert [v for block in blocks for v in block] == list(range(virtual))
    sizes = [len(b) for b in blocks]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_more_ranks_than_virtual_ranks_is_refused_by_name() -> None:
    with pytest.raises(UsageError, match="5 ranks for 4 virtual ranks: each rank needs at least one"):
        layout(4, 5)


def test_the_fold_is_left_to_right_and_the_order_changes_the_bits() -> None:
    """Why the order is fixed: summing the same float32 gradients in another grouping changes last bits."""
    g = [torch.randn(10_000, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    left = fold(g)
    assert torch.equal(left, (((g[0] + g[1]) + g[2]) + g[3]) / 4)
    pairwise = ((g[0] + g[1]) + (g[2] + g[3])) / 4  # what two ranks each summing their own pair would give
    assert not torch.equal(left, pairwise)
    assert torch.allclose(left, pairwise, rtol=1e-6, atol=1e-6)


def test_the_env_variable_is_read_and_checked() -> None:
    assert virtual_ranks_from_env({}) is None
    assert virtual_ranks_from_env({VIRTUAL_RANKS_ENV: " 8 "}) == 8
    for bad in ("0", "-2", "four"):
        with pytest.raises(UsageError, match="is not a number of virtual ranks"):
            virtual_ranks_from_env({VIRTUAL_RANKS_ENV: bad})


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def test_each_virtual_rank_reads_its_slice_with_its_own_random_stream_and_the_step_gets_the_ordered_mean() -> None:
    """One process running 4 virtual ranks: each sees what physical rank v of a 4-rank job would (its
    DistributedSampler slice, its random stream); the gradient and the logged loss are the folded means."""
    dataset = _data()

    def loader(v: int, count: int) -> DataLoader:
        return DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, count, v, seed=7))

    model = torch.nn.Linear(4, 1)
    job = Job(None, seed=5)
    ddp = job.ddp(model)
    state = State(model=model, loader=loader)
    for step in job.steps(state, total=2, virtual_ranks=4):
        with step:
            grads, losses, ranks = [], [], []
            for v in step.virtual_ranks():
                drawn = torch.rand(3)
                rng.reseed(5, v.index, "body", step.index)
                assert torch.equal(drawn, torch.rand(3)), "a virtual rank's stream is physical rank v's"
                sampler = DistributedSampler(dataset, 4, v.index, seed=7)
                sampler.set_epoch(0)
                indices = list(sampler)[4 * (step.index - 1):4 * step.index]
                x, y = v.batch
                assert torch.equal(x, dataset.tensors[0][indices])
                loss = F.mse_loss(ddp(x), y)
                loss.backward()
                grads.append(model.weight.grad.clone())
                losses.append(loss.detach())
                ranks.append(v.index)
                v.log(loss=loss)
            assert ranks == [0, 1, 2, 3]
            assert model.weight.grad is not None
            assert torch.equal(model.weight.grad, fold(grads))
            assert step.metrics["loss"] == float(fold([t.reshape(1) for t in losses]).item())
        assert step.committed
    assert ddp.invariant and ddp.current() is model  # no DDP, no reducer: undying reduces


def test_the_mode_is_off_unless_asked_and_its_misuses_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VIRTUAL_RANKS_ENV, raising=False)
    model = torch.nn.Linear(4, 1)
    for step in Job(None).steps(State(model=model), total=1):
        with step, pytest.raises(UsageError, match="step.virtual_ranks\\(\\) needs invariant mode"):
            step.virtual_ranks()
    plain = DataLoader(_data(), batch_size=4)
    with pytest.raises(UsageError, match="State\\(loader=...\\) takes a function \\(virtual_rank, virtual_ranks\\)"):
        next(Job(None).steps(State(model=model, loader=plain), total=1, virtual_ranks=2))
    with pytest.raises(UsageError, match="needs State\\(model=...\\)"):
        next(Job(None).steps(State(), total=1, virtual_ranks=2))
    with pytest.raises(UsageError, match="give a whole number >= 1"):
        next(Job(None).steps(State(model=model), total=1, virtual_ranks=0))
    monkeypatch.setenv(VIRTUAL_RANKS_ENV, "4")
    with pytest.raises(UsageError, match="the job has one number of virtual ranks"):
        next(Job(None).steps(State(model=model), total=1, virtual_ranks=2))


def test_virtual_ranks_that_log_different_names_are_refused() -> None:
    model = torch.nn.Linear(4, 1)
    step = next(Job(None).steps(State(model=model), total=1, virtual_ranks=2))
    with pytest.raises(UsageError, match="every virtual rank logs the same names"), step:
        for v in step.virtual_ranks():
            model(torch.ones(1, 4)).sum().backward()
            v.log(**({"loss": 1.0} if v.index == 0 else {"other": 1.0}))


def test_undying_run_checks_virtual_ranks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    argv = ["run", "--job-dir", str(tmp_path / "job"), str(script)]
    with pytest.raises(SystemExit) as exited:
        main(["run", "--virtual-ranks", "0", *argv[1:]])
    assert exited.value.code == 2
    assert "argument --virtual-ranks: '0' is not a number of virtual ranks" in capsys.readouterr().err
    assert main(["run", "-n", "4", "--virtual-ranks", "2", *argv[1:]]) == 2
    assert "--virtual-ranks 2 with up to 4 ranks: each rank runs at least one virtual rank" in capsys.readouterr().err


def test_the_shrink_demo_checks_its_incidents() -> None:
    """``undying demo --fault shrink`` passes only when node 1's ranks were lost and regrouped and node 1 joined."""
    lost = [{"kind": "node-loss", "rank": r, "status": "recovered"} for r in (2, 3)]
    joined = {"kind": "node-joined", "rank": -1, "status": "recovered"}
    assert check_incidents([*lost, joined]) == []
    assert check_incidents(lost) == ["no node-joined incident: the job did not grow back"]
    assert check_incidents([lost[0], joined]) == ["node-loss incidents name ranks [2], not node 1's ranks [2, 3]"]
    assert check_incidents([*lost, {**joined, "status": "failed"}]) == ["incident node-joined of rank -1 is failed"]


def test_the_shrink_demo_refuses_in_one_line_with_the_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    assert refuse("not root", as_json=True) == 2
    out, err = capsys.readouterr()
    assert err == "undying: error: demo --fault shrink cannot run here: not root\n"
    result = json.loads(out)
    assert result["fault"] == "shrink" and result["ok"] is False and result["identical"] is False
