"""Data-parallel invariance of masked_whiten, explained_variance and the group estimators' batch
baseline (ppo.zero_std_advantage) on two gloo ranks (CPU).

Two ranks holding different numbers of rows and different masks must whiten with
the statistics of the concatenated batch, as one process would, and report its explained
variance; distributed=False must give each rank its own statistics.
"""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_ppo.algo import explained_variance, masked_whiten
from ds_ppo.algo.estimators import AdvantageInputs, advantages_for
from conftest import mask_from_lengths

WORLD_SIZE = 2
T = 6
# Rows per rank differ (3 vs 2); rank 1 has an empty row and garbage outside the mask.
LENGTHS = [torch.tensor([6, 2, 4]), torch.tensor([0, 5])]


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    mask = mask_from_lengths(LENGTHS[rank], T)
    x = 3.0 + (rank + 1) * torch.randn(len(LENGTHS[rank]), T, generator=gen)  # ranks differ in mean and scale
    return torch.where(mask, x, torch.full_like(x, float("nan"))), mask


def _values(rank: int) -> torch.Tensor:
    """A critic's guess of rank's _batch: off by noise, NaN outside the mask."""
    gen = torch.Generator().manual_seed(200 + rank)
    x = _batch(rank)[0]
    return x + 0.5 * torch.randn(x.shape, generator=gen)


def _reference(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whitening written out with torch's own unbiased std on the valid values."""
    valid = x[mask].double()
    whitened = (valid - valid.mean()) / torch.sqrt(valid.var() + 1e-8)
    if not shift_mean:
        whitened = whitened + valid.mean()
    out = torch.zeros_like(x)
    out[mask] = whitened.to(x.dtype)
    return out


def _worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        x, mask = _batch(rank)
        batches = [_batch(r) for r in range(WORLD_SIZE)]
        x_all = torch.cat([b[0] for b in batches])
        mask_all = torch.cat([b[1] for b in batches])
        rows = slice(0, 3) if rank == 0 else slice(3, 5)

        for shift_mean in (True, False):
            # Across ranks: this rank's rows of the one-process whitening of the concatenation.
            global_ref = _reference(x_all, mask_all, shift_mean)[rows]
            torch.testing.assert_close(masked_whiten(x, mask, shift_mean=shift_mean), global_ref)
            # Per-rank: own statistics only.
            local = masked_whiten(x, mask, shift_mean=shift_mean, distributed=False)
            torch.testing.assert_close(local, _reference(x, mask, shift_mean))
            assert not torch.allclose(local, global_ref)  # the two scopes really differ here

        everywhere = explained_variance(torch.cat([_values(r) for r in range(WORLD_SIZE)]),
                                        x_all, mask_all)
        values = _values(rank)
        torch.testing.assert_close(explained_variance(values, x, mask), everywhere)
        local = explained_variance(values, x, mask, distributed=False)
        assert not torch.allclose(local, everywhere)

        # the batch baseline of constant groups: this rank's rows of one process's advantages
        scores = [_group_scores(r) for r in range(WORLD_SIZE)]
        mine = _zero_std_advantages(scores[rank])
        torch.testing.assert_close(mine, _batch_baseline(torch.cat(scores))[rank * 6:(rank + 1) * 6])
        assert not torch.allclose(mine, _batch_baseline(scores[rank]))  # not this rank's alone
    finally:
        dist.destroy_process_group()


def _group_scores(rank: int) -> torch.Tensor:
    """Three groups of two per rank: rank 0 one group with a spread and two constant ones,
    rank 1 scores higher on average."""
    return [torch.tensor([1.0, 0.0, 0.1, 0.1, 1.1, 1.1]),
            torch.tensor([1.1, 1.1, 1.1, 0.1, 1.1, 1.1])][rank]


def _zero_std_advantages(scores: torch.Tensor) -> torch.Tensor:
    rewards = torch.zeros(len(scores), 3)
    rewards[:, -1] = scores
    mask = torch.ones(len(scores), 3, dtype=torch.bool)
    x = AdvantageInputs(rewards, mask, None, group_size=2, zero_std_advantage=0.5)
    return advantages_for("grpo", x)[0][:, 0]


def _batch_baseline(scores: torch.Tensor) -> torch.Tensor:
    """GRPO on the groups with a spread; 0.5 x the score whitened over `scores` on the others."""
    g = scores.reshape(-1, 2)
    grpo = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)
    batch = 0.5 * (g - scores.mean()) / torch.sqrt(scores.var() + 1e-8)
    return torch.where(g[:, :1] == g[:, 1:], batch, grpo).reshape(-1)


def test_masked_whiten_two_gloo_ranks_equals_concatenated_batch(tmp_path):
    # FileStore rendezvous: no port to pick. mp.spawn raises if either rank's asserts fail.
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"),), nprocs=WORLD_SIZE, join=True)


def test_masked_whiten_without_process_group_is_local(monkeypatch):
    # another test in this worker may have left a (world-1) group: the state this test means is
    # "no process group", set here, not left to the order the files ran in
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    x, mask = _batch(0)
    torch.testing.assert_close(masked_whiten(x, mask), _reference(x, mask))
