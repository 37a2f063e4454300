"""Prompt layout and chat-template splicing.

Layout (one, documented, used by every order policy)::

    system message = static items ⊕ "Context:\\n" chunk ⊕ chunk ⊕ … ⊕ demoted items
    then the history turns, each its own chat message
    then one user message = the question (+ the generation prompt)

Items inside the system message are joined with ``separator`` ("\\n\\n"), chunks with
``chunk_delimiter`` ("\\n\\n"). Static items are the system prompt and few-shot examples;
*demoted* items are static segments that turned out to change on every request (silent
invalidators), moved after the chunks. Putting the context in the system message keeps the
natural stable-first order inside any chat template: system, context, history, question.

With a chat template, the template is rendered once per conversation shape (the roles of
the history turns) around unique placeholder strings and split there; the static pieces are
tokenized once and cached, and segment token ids are spliced between them. Without a chat
template (or ``chat_template=False``) the plain layout is
``system message ⊕ "\\n\\n{Role}: {turn}"… ⊕ "\\n\\nQuestion: {question}\\nAnswer:"``.

:func:`render_chat` is ragkv's one chat renderer: the assembler, the framework adapters and
``ragkv serve`` all render messages with it, so a prompt means the same everywhere.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ragkv.assembler.tokenization import TextTokenizer, chat_template_of
from ragkv.errors import ConfigError

_MAX_FRAMES = 64


@dataclass(slots=True, frozen=True)
class Layout:
    """The fixed text between segments."""

    separator: str = "\n\n"
    chunk_delimiter: str = "\n\n"
    context_header: str = "Context:\n"
    question_prefix: str = "\n\nQuestion: "  # plain layout only
    answer_prefix: str = "\nAnswer:"  # plain layout only


@dataclass(slots=True, frozen=True)
class Piece:
    """Static text with its token ids, tokenized once."""

    text: str
    token_ids: tuple[int, ...]


class PromptTemplate:
    """The static pieces of the prompt, tokenized once per conversation shape."""

    def __init__(
        self, tokenizer: TextTokenizer, layout: Layout | None = None, chat_template: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.layout = layout or Layout()
        self.uses_chat_template = chat_template and tokenizer.chat_template is not None
        self.separator = self.piece(self.layout.separator)
        self.chunk_delimiter = self.piece(self.layout.chunk_delimiter)
        self.context_header = self.piece(self.layout.context_header)
        self._frames: OrderedDict[tuple[str, ...], tuple[Piece, ...]] = OrderedDict()

    def piece(self, text: str) -> Piece:
        """Tokenize a static string of the template (its special-token strings are special)."""
        return Piece(text, tuple(self.tokenizer.encode_template(text)))

    def frame(self, history_roles: tuple[str, ...]) -> tuple[Piece, ...]:
        """The static pieces around the message slots (system, each turn, question).

        ``len(result) == len(history_roles) + 3``: before the system message content,
        between consecutive slots, and after the question.
        """
        frame = self._frames.get(history_roles)
        if frame is not None:
            self._frames.move_to_end(history_roles)
            return frame
        texts = self._split(history_roles)
        frame = tuple(self.piece(text) for text in texts)
        self._frames[history_roles] = frame
        if len(self._frames) > _MAX_FRAMES:
            self._frames.popitem(last=False)
        return frame

    def _split(self, history_roles: tuple[str, ...]) -> list[str]:
        roles = ("system", *history_roles, "user")
        messages = [{"role": r, "content": _holder(i)} for i, r in enumerate(roles)]
        texts = split_at_holders(self._render(messages), len(roles))
        if texts is None:
            raise ConfigError(
                "The chat template does not reproduce each message's content verbatim "
                f"once (roles {roles}); pass chat_template=False to use the plain layout."
            )
        return texts

    def _render(self, messages: list[dict[str, str]]) -> str:
        if not self.uses_chat_template:
            return render_plain(messages, self.layout)
        try:
            return render_chat(self.tokenizer.tokenizer, messages)
        except Exception as exc:  # jinja raises its own error types for unsupported roles
            raise ConfigError(
                f"The chat template cannot render roles {[m['role'] for m in messages]}: "
                f"{exc}. Pass chat_template=False to use the plain layout."
            ) from exc


def render_chat(
    tokenizer: Any, messages: Sequence[dict[str, str]], layout: Layout | None = None
) -> str:
    """``messages`` as prompt text: the tokenizer's chat template with the generation prompt,
    or, when the tokenizer has no chat template, :func:`render_plain` (the one fallback).

    Tokenize the result with ``add_special_tokens=False``: a template writes its own BOS.
    """
    if chat_template_of(tokenizer) is None:
        return render_plain(messages, layout or Layout())
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


def chat_token_ids(tokenizer: TextTokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` as :func:`render_chat` renders them, with every message's
    content encoded literally: a special-token string a user, a document or a tool put in a
    message is text, never a control token. The template's own text keeps its special tokens.

    The template is rendered once per conversation shape (its roles) around unique
    placeholders, split there and kept; each call renders the real messages once, to check
    that the template reproduced every content verbatim. One that trims or escapes contents
    is encoded as rendered, special tokens parsed, which is what Hugging Face does.
    """
    real = render_chat(tokenizer.tokenizer, messages)
    frame = _chat_frame(tokenizer, tuple(m["role"] for m in messages))
    contents = [m["content"] for m in messages]
    if frame is not None:
        *pieces, rest = frame
        joined = "".join(p.text + c for p, c in zip(pieces, contents, strict=True)) + rest.text
        if joined == real:
            ids: list[int] = []
            for piece, content in zip(pieces, contents, strict=True):
                ids += piece.token_ids
                ids += tokenizer.encode(content)
            return ids + list(rest.token_ids)
    return tokenizer.encode_template(real)


_CHAT_FRAMES_LOCK = threading.Lock()
_CHAT_FRAMES: OrderedDict[tuple[str, str, tuple[str, ...]], tuple[Piece, ...] | None] = (
    OrderedDict()
)


def _chat_frame(tokenizer: TextTokenizer, roles: tuple[str, ...]) -> tuple[Piece, ...] | None:
    """The template's text around each message of a conversation of ``roles``, tokenized,
    rendered once per (tokenizer, roles) and kept (bounded); None when the template does not
    reproduce placeholder contents once each."""
    key = (tokenizer.key, tokenizer.chat_template or "", roles)
    with _CHAT_FRAMES_LOCK:
        if key in _CHAT_FRAMES:
            _CHAT_FRAMES.move_to_end(key)
            return _CHAT_FRAMES[key]
    shaped = [{"role": role, "content": _holder(i)} for i, role in enumerate(roles)]
    split = split_at_holders(render_chat(tokenizer.tokenizer, shaped), len(roles))
    frame = None
    if split is not None:
        frame = tuple(Piece(text, tuple(tokenizer.encode_template(text))) for text in split)
    with _CHAT_FRAMES_LOCK:
        _CHAT_FRAMES[key] = frame
        if len(_CHAT_FRAMES) > _MAX_FRAMES:
            _CHAT_FRAMES.popitem(last=False)
    return frame


_HOLDER = re.compile("\ue000ragkv(\\d+)\ue001")


def _holder(i: int) -> str:
    """A placeholder no message text contains (private-use code points around a number)."""
    return f"\ue000ragkv{i}\ue001"


def split_at_holders(rendered: str, count: int) -> list[str] | None:
    """The text around placeholders 0 .. count-1, when each appears exactly once and in
    order (``count + 1`` pieces), else None. One regex pass: linear in the text, whatever
    the number of messages."""
    parts = _HOLDER.split(rendered)
    if parts[1::2] != [str(i) for i in range(count)]:
        return None
    return parts[0::2]


def render_plain(messages: Sequence[dict[str, str]], layout: Layout) -> str:
    """The plain layout (no chat template): a leading system message's content as is, each
    later message but the last as ``"\\n\\n{Role}: {content}"``, then the last message (the
    question) between ``layout.question_prefix`` and ``layout.answer_prefix``."""
    *turns, question = messages
    system = turns.pop(0)["content"] if turns and turns[0]["role"] == "system" else None
    history = "".join(f"\n\n{m['role'].title()}: {m['content']}" for m in turns)
    text = f"{system or ''}{history}{layout.question_prefix}{question['content']}"
    text += layout.answer_prefix
    return text if system is not None else text.removeprefix("\n\n")
