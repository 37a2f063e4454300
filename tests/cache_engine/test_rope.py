"""RopeRotator: a stored key re-rotated to another position equals the key the model
computes there.

Keys come from the model itself: a capturing attention function records layer 0's
post-RoPE keys, which depend only on the token and its position. The key at position 0 is
the unrotated key (times the rope's attention scaling), which gives an fp64 truth at any
position. Observed on the tiny configs below (max error / max |key|): the exact rotation
``delta * inv_freq`` agrees with a fresh computation to 4.7e-5 at positions near 4000, which
is transformers' own fp32 angle rounding (its fresh keys are that far from the fp64 truth);
with ``old_positions`` it reproduces those angles and agrees to 2.1e-7.
"""

from __future__ import annotations

import pytest
import torch
from support import tiny_config
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ragkv.cache_engine.rope import RopeRotator
from ragkv.errors import InvalidInputError, UnsupportedModelError

CAPTURE = "ragkv_test_key_capture"
_captured: dict[str, torch.Tensor] = {}


def _capture(module, query, key, value, attention_mask, **kwargs):
    if module.layer_idx == 0:
        _captured["key"] = key[0].transpose(0, 1).clone()  # [n, kv_heads, head_dim]
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CAPTURE, _capture)

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}
CONFIGS = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama-theta-1e6": ("llama", {"rope_theta": 1e6}),
    "llama3-scaling": ("llama", {"rope_theta": 500000.0, "rope_scaling": LLAMA3}),
    "yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
    "linear": ("qwen2", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
}
N = 12


def make_model(family: str, **overrides):
    torch.manual_seed(0)
    config = tiny_config(family, max_position_embeddings=8192, **overrides)
    return AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=CAPTURE
    ).eval()


@torch.inference_mode()
def keys_at(model, ids: list[int], positions: list[int]) -> torch.Tensor:
    model(torch.tensor([ids]), position_ids=torch.tensor([positions]))
    return _captured["key"]


def rotate64(key: torch.Tensor, positions: list[int], inv_freq: torch.Tensor) -> torch.Tensor:
    """fp64 rotation of ``key`` by ``positions * inv_freq`` (rotate_half convention)."""
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq.double()
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = key.double().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def max_rel_error(got: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    return ((got.double() - want.double()).abs().max() / scale).item()


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request):
    family, overrides = CONFIGS[request.param]
    model = make_model(family, **overrides)
    ids = torch.randint(3, 500, (N,), generator=torch.Generator().manual_seed(1)).tolist()
    return request.param, model, RopeRotator.from_model(model), ids


# (old start, new start): large positive and negative deltas, small ones, mid-context
MOVES = [(3, 4003), (4003, 3), (100, 37), (1000, 1005)]


@pytest.mark.parametrize(("a", "b"), MOVES)
def test_keys_moved_to_another_offset_equal_keys_computed_there(case, a, b):
    name, model, rotator, ids = case
    old, new = list(range(a, a + N)), list(range(b, b + N))
    stored, fresh = keys_at(model, ids, old), keys_at(model, ids, new)
    scale = fresh.abs().max().item()
    # The exact rotation: within transformers' fp32 angle rounding (~2**-13 rad near 4000).
    assert max_rel_error(rotator.rotate(stored, b - a), fresh, scale) < 1e-4
    # Reproducing transformers' angles at both positions: fp32 rounding of the keys.
    moved = rotator.rotate(stored, torch.full((N,), b - a), old_positions=torch.tensor(old))
    assert max_rel_error(moved, fresh, scale) < 1e-6
    # Against the fp64 truth, from the unrotated key at position 0: only the stored key's
    # own rounding at ``a`` remains (under 1e-6 only for a small ``a``: 1.8e-6 at 100).
    truth = rotate64(keys_at(model, ids, [0] * N), new, rotator.inv_freq)
    if a < 16:
        assert max_rel_error(rotator.rotate(stored, b - a), truth, scale) < 1e-6


def test_scattered_per_token_deltas_match_keys_computed_there(case):
    name, model, rotator, ids = case
    gen = torch.Generator().manual_seed(2)
    old = torch.randint(0, 4096, (N,), generator=gen)
    new = torch.randint(0, 4096, (N,), generator=gen)
    stored, fresh = keys_at(model, ids, old.tolist()), keys_at(model, ids, new.tolist())
    scale = fresh.abs().max().item()
    assert max_rel_error(rotator.rotate(stored, new - old), fresh, scale) < 1e-4
    moved = rotator.rotate(stored, new - old, old_positions=old)
    assert max_rel_error(moved, fresh, scale) < 1e-6


def test_the_rotation_does_not_apply_the_attention_scaling_again():
    model = make_model("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert model.model.rotary_emb.attention_scaling > 1.1  # the stored keys carry it once
    ids = list(range(3, 3 + N))
    stored, fresh = keys_at(model, ids, [0] * N), keys_at(model, ids, list(range(50, 50 + N)))
    moved = RopeRotator.from_model(model).rotate(stored, torch.arange(50, 50 + N))
    assert max_rel_error(moved, fresh, fresh.abs().max().item()) < 1e-6


def test_the_frequencies_follow_rope_theta_and_scaling():
    default = RopeRotator.from_model(make_model("llama")).inv_freq
    theta = RopeRotator.from_model(make_model("llama", rope_theta=1e6)).inv_freq
    llama3 = RopeRotator.from_model(make_model("llama", **CONFIGS["llama3-scaling"][1])).inv_freq
    assert theta[-1] < default[-1]
    plain = 1.0 / 500000.0 ** (torch.arange(0, 16, 2) / 16)
    assert llama3[0] == pytest.approx(plain[0]) and llama3[-1] == pytest.approx(plain[-1] / 8)


def test_low_precision_keys_keep_their_dtype():
    rotator = RopeRotator.from_model(make_model("qwen3"))
    keys = torch.randn(N, 2, 16)
    want = rotator.rotate(keys, 4000)
    for dtype, atol in ((torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        got = rotator.rotate(keys.to(dtype), 4000)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=atol * 4, rtol=atol)


def test_rope_types_that_depend_on_the_sequence_are_refused():
    longrope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 1024,
    }
    with pytest.raises(UnsupportedModelError, match="longrope"):
        RopeRotator.from_model(make_model("llama", rope_scaling=longrope))
    with pytest.raises(UnsupportedModelError, match="rotary"):
        RopeRotator.from_model(torch.nn.Linear(2, 2))


def test_bad_keys_and_deltas_are_refused():
    rotator = RopeRotator.from_model(make_model("llama"))
    keys = torch.randn(4, 2, 16)
    for bad_keys in (torch.randn(4, 16), torch.randn(4, 2, 8), keys.long()):
        with pytest.raises(InvalidInputError):
            rotator.rotate(bad_keys, 1)
    for bad_delta in (torch.ones(4), torch.ones(3, dtype=torch.long), 1.5):
        with pytest.raises(InvalidInputError):
            rotator.rotate(keys, bad_delta)
