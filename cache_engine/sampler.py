"""Next-token selection for a batch: greedy argmax or seeded top-k / top-p / min-p sampling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.errors import InvalidInputError


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one generated token, from ``log_softmax`` of the raw logits.

    ``top`` holds the ``n`` most likely ``(token_id, logprob)`` pairs, best first (empty for
    ``logprobs=0``). The values describe the model's distribution, not the temperature-scaled
    or filtered one the token was drawn from (vLLM's default "raw logprobs").
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class SamplerOutput:
    """One chosen token per row; ``logprobs[i]`` is None unless row i asked for logprobs."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The per-request generator for ``params``: seeded when ``params.seed`` is set.

    Returns None for greedy requests (they draw nothing) and for unseeded ones (they draw from
    torch's global generator). A CPU generator serves logits on any device: a row draws a
    single number from it.
    """
    if params.greedy or params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


class Sampler:
    """Picks the next token of every row of a logits batch.

    Greedy rows take ``argmax`` (ties go to the lowest id). Sampling rows scale by temperature,
    filter (top-k, then top-p and min-p on the top-k renormalised distribution) and invert the
    CDF of what is left at one uniform drawn from the row's own generator. Nothing a row does
    depends on the other rows, so a seeded request yields the same tokens whichever other
    requests share the batch.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` ``[num_seqs, vocab]`` (any float dtype)."""
        _check_batch(logits, params, generators)
        logits = logits.float()
        random = [i for i, p in enumerate(params) if not p.greedy]
        if not random:
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
            greedy = [i for i, p in enumerate(params) if p.greedy]
            if greedy:
                token_ids[greedy] = logits[greedy].argmax(dim=-1)
            probs = _filtered_probs(logits[random], [params[i] for i in random])
            token_ids[random] = _inverse_cdf(probs, [generators[i] for i in random])
        ids = token_ids.tolist()
        return SamplerOutput(token_ids=ids, logprobs=_logprobs(logits, params, ids))


def _check_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise InvalidInputError(
            f"logits must be a float tensor [num_seqs, vocab], got {logits.dtype} {tuple(logits.shape)}."
        )
    if not len(params) == len(generators) == logits.shape[0]:
        raise InvalidInputError(
            f"need one SamplingParams and one generator per logits row: {logits.shape[0]} rows, "
            f"{len(params)} params, {len(generators)} generators."
        )


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax of ``logits / temperature`` with filtered-out tokens set to 0 (not renormalised)."""
    device, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], device=device)
    probs = (logits / temps.unsqueeze(1)).softmax(dim=-1)
    truncated = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if truncated:
        rows = [params[i] for i in truncated]
        probs[truncated] = _top_k_top_p(probs[truncated], rows)
    if any(p.min_p > 0 for p in params):
        # The best token survives top-k/top-p, so its probability is the same reference.
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _top_k_top_p(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Zero every token outside each row's top-k, then outside its top-p nucleus of that top-k.

    Sorting the whole vocabulary is the slow part, so only the ``c`` best candidates are
    ranked, with ``c`` covering every row's top-k; ``c`` grows until each top-k-less row's
    candidates hold more than ``top_p`` of its mass, which proves every token left out would be
    cut anyway.
    """
    device, vocab = probs.device, probs.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_k = torch.tensor(ks, device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    row_mass = probs.sum(dim=-1)
    c = min(vocab, max([64, *(k for k in ks if k < vocab)]))
    while True:
        vals, ids = probs.topk(c, dim=-1)  # sorted, best first
        vals.masked_fill_(torch.arange(c, device=device) >= top_k.unsqueeze(1), 0.0)
        k_inside = top_k <= c
        top_mass = vals.sum(dim=-1)
        kept_mass = torch.where(k_inside, top_mass, row_mass)
        if c == vocab or bool((k_inside | (top_mass > top_p * row_mass)).all()):
            break
        c = min(vocab, 4 * c)
    # The best token has nothing before it, so it is never cut.
    mass_before = vals.cumsum(dim=-1) - vals
    vals.masked_fill_(mass_before > (top_p * kept_mass).unsqueeze(1), 0.0)
    return torch.zeros_like(probs).scatter_(-1, ids, vals)


def _inverse_cdf(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row from unnormalised ``probs`` with one uniform from the row's generator.

    One draw per row keeps a seeded request's stream independent of the batch and costs far
    less than a vocabulary of exponential draws on CPU; the float64 CDF keeps tail tokens exact
    enough.
    """
    u = torch.stack([_uniform(gen, probs.device) for gen in generators]).to(probs.device)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True)
    # u * total can round up to total and land past the end (or on a trailing zero): step back
    # to the last token that can be drawn.
    picked = picked.clamp_(max=probs.shape[-1] - 1)
    stray = probs.gather(1, picked).squeeze(1) == 0
    picked = picked.squeeze(1)
    if bool(stray.any()):
        last = probs.shape[-1] - 1 - (probs[stray] > 0).flip(-1).int().argmax(dim=-1)
        picked[stray] = last
    return picked


def _uniform(gen: torch.Generator | None, device: torch.device) -> torch.Tensor:
    where = gen.device if gen is not None else device
    return torch.rand((), generator=gen, device=where, dtype=torch.float64)


def _logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], token_ids: list[int]
) -> list[TokenLogprobs | None]:
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not wanted:
        return out
    logprobs = logits[wanted].log_softmax(dim=-1)
    n_max = min(max(params[i].logprobs or 0 for i in wanted), logits.shape[-1])
    top_val_list: list[list[float]] = []
    top_id_list: list[list[int]] = []
    if n_max:
        top_vals, top_ids = logprobs.topk(n_max, dim=-1)
        top_val_list, top_id_list = top_vals.tolist(), top_ids.tolist()
    chosen = logprobs.gather(
        1, torch.tensor([[token_ids[i]] for i in wanted], device=logits.device)
    )
    chosen_list = chosen.squeeze(1).tolist()
    for row, i in enumerate(wanted):
        n = params[i].logprobs
        top = list(zip(top_id_list[row][:n], top_val_list[row][:n], strict=True)) if n else []
        out[i] = TokenLogprobs(token_id=token_ids[i], logprob=chosen_list[row], top=top)
    return out
