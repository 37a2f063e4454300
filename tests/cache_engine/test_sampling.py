import pytest
import torch

from ragkv.cache_engine.sampler import Sampler, _filtered_probs, make_generator
from ragkv.cache_engine.sampling_params import SamplingParams
from ragkv.errors import InvalidInputError

VOCAB = 1000


def _logits(rows: int, seed: int = 0, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def _sample(logits, params, generators=None):
    if generators is None:
        generators = [make_generator(p) for p in params]
    return Sampler()(logits, params, generators)


def _frequencies(logits_row, params, draws=20_000, seed=1234):
    # One seeded generator shared by every row: the rows draw one after another from it.
    gen = torch.Generator().manual_seed(seed)
    logits = logits_row.expand(draws, -1).contiguous()
    ids = _sample(logits, [params] * draws, [gen] * draws).token_ids
    return torch.bincount(torch.tensor(ids), minlength=logits.shape[-1]).double() / draws


def test_greedy_picks_the_argmax_of_each_row():
    logits = _logits(8)
    out = _sample(logits, [SamplingParams()] * 8)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_ties_go_to_the_lowest_token_id():
    logits = torch.zeros(2, 10)
    logits[0, [3, 7]] = 5.0
    logits[1, [9, 2]] = 1.0
    assert _sample(logits, [SamplingParams()] * 2).token_ids == [3, 2]


def test_greedy_on_half_precision_logits_matches_fp32_argmax():
    logits = _logits(4).to(torch.bfloat16)
    out = _sample(logits, [SamplingParams()] * 4)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()


def test_greedy_rows_stay_exact_in_a_mixed_batch():
    logits = _logits(6)
    params = [
        SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams() for i in range(6)
    ]
    out = _sample(logits, params)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.01, seed=7),
    ],
)
def test_same_seed_gives_same_tokens_whatever_shares_the_batch(params):
    steps = [_logits(1, seed=100 + s, scale=1.0)[0] for s in range(12)]

    def run(batch_size: int, position: int) -> list[int]:
        gen = make_generator(params)
        others = [
            SamplingParams(temperature=0.5 + 0.1 * j, seed=j) if j % 2 else SamplingParams()
            for j in range(batch_size)
        ]
        tokens = []
        for step, row in enumerate(steps):
            logits = _logits(batch_size, seed=step, scale=1.0)
            logits[position] = row
            batch = list(others)
            batch[position] = params
            gens = [make_generator(p) for p in batch]
            gens[position] = gen
            tokens.append(_sample(logits, batch, gens).token_ids[position])
        return tokens

    alone = run(1, 0)
    assert run(5, 3) == alone
    assert run(16, 15) == alone
    # The draws are really random: another seed takes another path, and it is not greedy.
    other_seed = SamplingParams(**{**_fields(params), "seed": 8})
    gen = make_generator(other_seed)
    rerolled = [_sample(r.unsqueeze(0), [other_seed], [gen]).token_ids[0] for r in steps]
    assert rerolled != alone
    assert alone != [int(r.argmax()) for r in steps]


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_top_k_one_equals_greedy():
    logits = _logits(16, seed=3)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(16)]
    assert _sample(logits, params).token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = _logits(16, seed=4)
    params = [SamplingParams(temperature=2.0, top_p=1e-6, seed=i) for i in range(16)]
    assert _sample(logits, params).token_ids == logits.argmax(dim=-1).tolist()


def test_min_p_one_equals_greedy():
    logits = _logits(16, seed=5)
    params = [SamplingParams(temperature=2.0, min_p=1.0, seed=i) for i in range(16)]
    assert _sample(logits, params).token_ids == logits.argmax(dim=-1).tolist()


def test_sampled_frequencies_match_the_softmax():
    logits = torch.tensor([1.0, 2.0, 0.5])
    freq = _frequencies(logits, SamplingParams(temperature=1.0))
    # 20k draws: one standard deviation is about 0.0035, so 0.015 is over four.
    torch.testing.assert_close(freq, logits.double().softmax(-1), atol=0.015, rtol=0)


def test_temperature_sharpens_the_sampled_distribution():
    logits = torch.tensor([1.0, 2.0, 0.5])
    freq = _frequencies(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(freq, (logits.double() / 0.5).softmax(-1), atol=0.015, rtol=0)


def test_top_k_samples_only_the_k_best_renormalised():
    logits = torch.tensor([0.0, 1.5, 1.0, 0.2, -1.0])
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_k=2))
    expected = torch.zeros(5, dtype=torch.float64)
    expected[[1, 2]] = logits[[1, 2]].double().softmax(-1)
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05: the mass before token 2 is 0.8 > 0.7, so it is cut.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    freq = _frequencies(logits, SamplingParams(temperature=1.0, top_p=0.7))
    expected = torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def _reference_filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Full-sort top-k -> top-p -> min-p, one row at a time, as the definition reads."""
    probs = (logits / p.temperature).softmax(-1)
    vals, order = probs.sort(descending=True, stable=True)
    keep = torch.ones_like(vals, dtype=torch.bool)
    if p.top_k > 0:
        keep[p.top_k :] = False
    kept = torch.where(keep, vals, 0.0)
    renorm = kept / kept.sum()
    keep &= (renorm.cumsum(-1) - renorm) <= p.top_p
    keep &= vals >= p.min_p * vals[0]
    out = torch.zeros_like(probs)
    out[order[keep]] = probs[order[keep]]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_filters_match_a_full_sort_reference(seed):
    vocab = 5000
    gen = torch.Generator().manual_seed(seed)
    # Flat rows (scale 0.3) force the candidate window to grow well past its first guess.
    logits = torch.randn(6, vocab, generator=gen) * torch.tensor([0.3, 1, 3, 0.3, 2, 5]).unsqueeze(
        1
    )
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=100, top_p=0.5),
        SamplingParams(temperature=1.2, top_k=300),
        SamplingParams(temperature=1.0, top_p=0.99, min_p=0.5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, min_p=0.05),
    ]
    got = _filtered_probs(logits, params)
    for row, p in enumerate(params):
        expected = _reference_filter(logits[row], p)
        assert torch.equal(got[row] > 0, expected > 0), f"row {row}: kept sets differ"
        torch.testing.assert_close(got[row], expected)


def test_logprobs_equal_log_softmax_of_the_raw_logits():
    logits = _logits(3, seed=9)
    params = [
        SamplingParams(temperature=0.7, seed=1, logprobs=5),
        SamplingParams(),
        SamplingParams(logprobs=0),
    ]
    out = _sample(logits, params)
    reference = logits.log_softmax(dim=-1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(reference[0, out.token_ids[0]].item(), abs=1e-6)
    top_vals, top_ids = reference[0].topk(5)
    assert [t for t, _ in first.top] == top_ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(top_vals.tolist(), abs=1e-6)
    assert out.logprobs[1] is None
    assert out.logprobs[2].top == []
    assert out.logprobs[2].logprob == pytest.approx(reference[2].max().item(), abs=1e-6)


def test_sampler_leaves_the_callers_logits_untouched():
    logits = _logits(4)
    before = logits.clone()
    _sample(logits, [SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.1, seed=1)] * 4)
    assert torch.equal(logits, before)


def test_unseeded_sampling_requests_get_no_generator():
    assert make_generator(SamplingParams(temperature=1.0)) is None
    assert make_generator(SamplingParams(seed=3)) is None  # greedy draws nothing
    assert make_generator(SamplingParams(temperature=1.0, seed=3)) is not None


def test_mismatched_batch_raises_invalid_input():
    with pytest.raises(InvalidInputError, match="one SamplingParams"):
        Sampler()(_logits(2), [SamplingParams()], [None])
    with pytest.raises(InvalidInputError, match="float tensor"):
        Sampler()(torch.zeros(4, dtype=torch.long), [SamplingParams()], [None])
