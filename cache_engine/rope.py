"""Re-rotation of stored (post-RoPE) keys to another position, for chunk reuse.

Rotary position embedding turns each pair of key channels ``(i, i + D/2)`` (transformers'
``rotate_half`` convention) by the angle ``position * inv_freq[i]``. Rotations compose, so a
key stored at position ``p`` becomes the key at ``p + d`` by one more rotation of
``d * inv_freq``: ``K(p + d) = R(d) K(p)``, with no need for the pre-RoPE key.

The cos/sin that transformers applies carry the model's ``attention_scaling`` (yarn and
longrope set it; 1 elsewhere). A stored key already holds that factor once, so the
re-rotation is the *unscaled* rotation. Only RoPE variants whose frequencies do not depend
on the sequence are supported: default, ``linear``, ``llama3``, ``yarn``, and ``dynamic``
within ``max_position_embeddings`` (past it, dynamic NTK recomputes its frequencies; the
engine never runs past that context).
"""

from __future__ import annotations

from typing import Any

import torch

from ragkv.errors import InvalidInputError, UnsupportedModelError

# RoPE types whose inv_freq is one fixed vector at every position the engine runs.
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "dynamic"})


class RopeRotator:
    """Rotates post-RoPE keys ``[n, kv_heads, head_dim]`` by a position delta.

    Build it with :meth:`from_model`; ``inv_freq`` is the model's ``[head_dim / 2]`` fp32
    frequency vector (as its rotary embedding holds it).
    """

    def __init__(self, inv_freq: torch.Tensor) -> None:
        if inv_freq.dim() != 1 or not inv_freq.is_floating_point() or len(inv_freq) == 0:
            raise InvalidInputError("inv_freq must be a non-empty 1-D float tensor.")
        self.inv_freq = inv_freq.detach().to("cpu", torch.float32)
        self.head_dim = 2 * len(inv_freq)
        self._per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> RopeRotator:
        """The rotator of a loaded Hugging Face model (llama, mistral, qwen2, qwen3).

        Reads the frequencies from the model's own rotary embedding (its unmodified
        ``original_inv_freq``, which transformers' rope init computed from ``rope_theta`` and
        ``rope_scaling``). Raises :class:`UnsupportedModelError` for a RoPE type whose
        frequencies vary with the sequence (``longrope``, ...), for partial rotary
        embeddings, and for a model without a rotary embedding.
        """
        # A transformers rotary embedding, found by its attributes (dynamic, hence Any).
        rotary: Any = next(
            (m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "rope_type")),
            None,
        )
        if rotary is None:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no rotary embedding module; chunk reuse needs a "
                "RoPE model (llama, mistral, qwen2, qwen3)"
            )
        rope_type = rotary.rope_type
        if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {rope_type!r} cannot be re-rotated exactly (its frequencies depend "
                f"on the sequence); supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))}"
            )
        inv_freq = getattr(rotary, "original_inv_freq", None)
        if inv_freq is None:
            inv_freq = rotary.inv_freq
        config: Any = model.config  # a transformers PretrainedConfig
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        if 2 * len(inv_freq) != head_dim:
            raise UnsupportedModelError(
                f"partial rotary embedding ({2 * len(inv_freq)} of {head_dim} channels rotated) "
                "is not supported for chunk reuse"
            )
        return cls(inv_freq)

    def rotate(
        self,
        keys: torch.Tensor,
        delta: torch.Tensor | int,
        old_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``keys`` ``[n, kv_heads, head_dim]`` (post-RoPE, as stored in the KV cache, any
        float dtype) as they would have been computed at ``old + delta``; returns a new
        tensor in the keys' dtype. ``delta``: int64 ``[n]`` (``new_pos - old_pos``) or an int.

        Math in fp32, angles in fp64. With ``old_positions`` (int ``[n]``), the angle is the
        difference of the fp32-rounded angles transformers uses at the two positions, so
        the result matches a fresh computation at the new position to rounding even where
        ``position * inv_freq`` loses precision in fp32 (about 1e-4 rad near 4000); without
        it, the rotation is the exact ``delta * inv_freq``.
        """
        if keys.dim() != 3 or keys.shape[2] != self.head_dim or not keys.is_floating_point():
            raise InvalidInputError(
                f"keys must be float [n, kv_heads, {self.head_dim}]; got {tuple(keys.shape)} "
                f"{keys.dtype}.",
                param="keys",
            )
        n, device = keys.shape[0], keys.device
        delta = torch.as_tensor(delta, device=device)
        if delta.is_floating_point() or delta.dim() > 1 or delta.numel() not in (1, n):
            raise InvalidInputError(
                f"delta must be an int or an integer tensor of [{n}] position deltas.",
                param="delta",
            )
        inv32, inv64 = self._freqs(device)
        delta = delta.reshape(-1, 1).to(torch.int64)
        if old_positions is None:
            angles = delta.double() * inv64
        else:
            old = torch.as_tensor(old_positions, device=device).reshape(-1, 1).to(torch.int64)
            if old.shape[0] not in (1, n):
                raise InvalidInputError(
                    f"old_positions must hold {n} positions.", param="old_positions"
                )
            # transformers: fp32(position) * fp32(inv_freq), rounded to fp32
            new = (old + delta).float() * inv32
            angles = new.double() - (old.float() * inv32).double()
        cos = angles.cos().float().unsqueeze(1)  # [n or 1, 1, head_dim / 2]
        sin = angles.sin().float().unsqueeze(1)
        k = keys.float()
        half = self.head_dim // 2
        x1, x2 = k[..., :half], k[..., half:]
        # x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(keys.dtype)

    def _freqs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``inv_freq`` in fp32 and fp64 on ``device`` (moved once per device)."""
        if device not in self._per_device:
            inv32 = self.inv_freq.to(device)
            self._per_device[device] = (inv32, inv32.double())
        return self._per_device[device]
