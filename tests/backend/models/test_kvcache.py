import torch

from backend.models.transformer import KVCache


def test_growth_respects_the_cap_and_keeps_contents() -> None:
    kv = KVCache(1, max_len=70)
    k = torch.arange(64 * 2, dtype=torch.float32).view(1, 64, 2)
    kv.write(0, 0, k, k)
    kk, _ = kv.write(0, 64, torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    assert kv.k[0].shape[1] == 70  # not doubled to 128
    assert torch.equal(kk[:, :64], k) and kk.shape[1] == 65


def test_uncapped_growth_is_geometric() -> None:
    kv = KVCache(1)
    kv.write(0, 0, torch.zeros(1, 64, 2), torch.zeros(1, 64, 2))
    kv.write(0, 64, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
    assert kv.k[0].shape[1] == 128
