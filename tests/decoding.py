"""What the cache tests share: seeded token ids, and the logits of a prompt prefilled in
one forward and then decoded one token a step through a cache."""

import torch


def tokens(n: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, n), generator=g)  # (1, n)


def decode_logits(model, cache, idx: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits of every position: the prompt prefilled in one forward, then one a step."""
    with torch.no_grad():
        steps = [model(idx[:, :prefill], 0, cache)]
        steps += [model(idx[:, p:p + 1], p, cache) for p in range(prefill, idx.size(1))]
    return torch.cat(steps, dim=1)  # (1, T, vocab)
