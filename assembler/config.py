"""One assembler configuration: every setting, its default and its check, in one place.

:class:`AssemblerConfig` is plain, frozen data, validated when it is built, so a bad
setting fails before a tokenizer is touched; :class:`~ragkv.assembler.Assembler` keeps
its learned state (stability, learned system-prompt heads, prefix tree, sent record)
apart from it, and :meth:`~ragkv.assembler.Assembler.fork` starts a new assembler from
the same config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypedDict

from ragkv.assembler.ordering import check_order
from ragkv.assembler.template import Layout
from ragkv.defaults import DEFAULT_BLOCK_SIZE
from ragkv.errors import ConfigError


@dataclass(frozen=True, slots=True)
class AssemblerConfig:
    """How an :class:`~ragkv.assembler.Assembler` assembles prompts.

    ``block_size``: the engine's KV block (plans and learned cuts align to it).
    ``order``: ``"stable-first"`` (default), ``"cache-aware"`` or ``"retrieval"`` (see
    :mod:`ragkv.assembler.ordering`). ``chat_template`` renders through the tokenizer's
    chat template; ``layout`` places the segments (:mod:`ragkv.assembler.template`).
    ``demote_invalidators`` keeps the stable head and tail of a "static" slot that changes
    on every request in place and moves only its changing part after the chunks
    (:mod:`ragkv.assembler.slots`); ``invalidator_after`` novel versions in a row mark a
    slot as changing. ``tree_max_nodes`` bounds the chunk prefix tree, ``sent_max_blocks``
    the record of sent prefixes. ``measure_seams`` reports where assembled token ids differ
    from tokenizing the text in one go. ``collapse_duplicates=False`` keeps byte-identical
    chunks as retrieved (what an application without a dedup stage sends).
    ``never_worse=False`` skips the comparison with the as-given order; the as-given plan
    must win by more than ``never_worse_slack`` tokens (None: one block plus the tokens a
    learned split gave up to cut on a text boundary; 0: strictly never worse).
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    order: str = "stable-first"
    chat_template: bool = True
    layout: Layout | None = None
    demote_invalidators: bool = True
    invalidator_after: int = 3
    tree_max_nodes: int = 16_384
    measure_seams: bool = False
    collapse_duplicates: bool = True
    never_worse: bool = True
    never_worse_slack: int | None = None
    sent_max_blocks: int = 65_536

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(
                f"block_size must be >= 1, got {self.block_size}.", param="block_size"
            )
        check_order(self.order)
        if self.invalidator_after < 2:
            raise ConfigError(
                "Changing slots are detected after >= 2 novel versions in a row "
                f"(invalidator_after), got {self.invalidator_after}.",
                param="invalidator_after",
            )
        for name in ("tree_max_nodes", "sent_max_blocks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}.", param=name)

    def replace(self, **changes: Any) -> AssemblerConfig:
        """A copy with some settings changed (validated again)."""
        return dataclasses.replace(self, **changes)


class AssemblerSettings(TypedDict, total=False):
    """:class:`AssemblerConfig`'s settings as an ``Assembler``'s keywords (None, or left out:
    the config's default); ``block_size`` and ``order`` are its positional parameters."""

    chat_template: bool | None
    layout: Layout | None
    demote_invalidators: bool | None
    invalidator_after: int | None
    tree_max_nodes: int | None
    measure_seams: bool | None
    collapse_duplicates: bool | None
    never_worse: bool | None
    never_worse_slack: int | None
    sent_max_blocks: int | None
