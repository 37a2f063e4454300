"""Text boundaries: a moved part of a system prompt starts and ends between sentences or lines.

Two routes move the changing part of a system prompt after the retrieved chunks:
``SystemPrompt(template, **values)`` (the caller marks the values) and the slot learner (a
plain string that changes on every request). Both must cut only on a text boundary
(:mod:`ragkv.assembler.boundaries`): never inside a word, a number, a version or a price,
and the pieces must put back together into the original text byte for byte. Each prompt
below is a realistic system prompt, English or Chinese, with its changing values in a
different place.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from ragkv.assembler import Assembler, SegmentKind, Stability, SystemPrompt, Volatile
from ragkv.assembler.boundaries import is_boundary, last_boundary, next_boundary

VERSIONS = 8  # requests per prompt in the learned route: the values change on every one

CHUNKS = [
    "Refunds are issued to the original payment method within 5 to 7 business days after "
    "the returned item is received at the warehouse.",
    "Premium members get free express shipping on orders over $25.00 and can cancel their "
    "membership at any time from the account page.",
]

NAMES = [
    "Maria Gonzalez",
    "Wei Chen",
    "Aisha Okafor",
    "Liam O'Brien",
    "Priya Natarajan",
    "Jonas Becker",
    "Sofia Rossi",
    "Kenji Watanabe",
]
CN_NAMES = ["王小明", "李娜", "张伟", "刘洋", "陈静", "杨帆", "赵磊", "黄丽"]
TIERS = ["Gold", "Silver", "Platinum", "Bronze"]
CN_TIERS = ["金卡", "银卡", "白金卡"]
ZONES = [
    "Europe/Berlin",
    "America/New_York",
    "Asia/Tokyo",
    "Australia/Sydney",
    "America/Sao_Paulo",
    "Africa/Lagos",
    "Asia/Kolkata",
    "Europe/London",
]
LOCALES = ["en-US", "en-GB", "fr-FR", "de-DE", "es-MX", "pt-BR", "ja-JP", "it-IT"]
TOOL_SETS = [
    ["search_docs", "get_weather"],
    ["search_docs", "create_ticket", "calculator"],
    ["calculator", "send_email"],
    ["lookup_order", "create_ticket"],
    ["search_docs", "lookup_order", "send_email", "calculator"],
    ["get_weather"],
    ["create_ticket", "send_email", "get_weather"],
    ["lookup_order", "calculator", "search_docs"],
]
THEMES = [
    "space exploration",
    "ancient Rome",
    "jazz history",
    "ocean life",
    "world capitals",
    "famous inventors",
    "board games",
    "volcanoes",
]
CN_THEMES = [
    "太空探索",
    "古罗马",
    "爵士乐历史",
    "海洋生物",
    "世界首都",
    "著名发明家",
    "桌游",
    "火山",
]
DRINKS = ["oat latte", "cold brew", "flat white", "mocha", "cortado", "chai latte", "macchiato"]
CN_DRINKS = ["燕麦拿铁", "冷萃咖啡", "馥芮白", "摩卡", "可塔朵", "印度奶茶", "玛奇朵"]
SYMPTOMS = [
    "headache and fever",
    "sore throat",
    "back pain after lifting",
    "dizziness",
    "a rash on both arms",
    "persistent cough",
    "ear pain",
    "nausea since breakfast",
]


@dataclass(frozen=True)
class Case:
    """A system prompt template and its values on the ``i``-th request."""

    name: str
    template: str
    values: Callable[[int], dict[str, str]]

    def text(self, i: int) -> str:
        return self.template.format(**self.values(i))

    def prompt(self, i: int) -> SystemPrompt:
        return SystemPrompt(self.template, **self.values(i))


CASES = [
    # -- English --------------------------------------------------------------------------
    Case(
        "date-first-sentence",
        "Today is {date}. You are Nova, the support assistant for Brightline Internet. "
        "Answer billing and outage questions using only the provided documents. If the "
        "documents do not cover a question, say so and offer to open a ticket.",
        lambda i: {"date": f"2025-03-{i + 1:02d}"},
    ),
    Case(
        "timestamp-last-line",
        "You are a careful research assistant for the Northwind legal team.\n"
        "Cite the document title for every claim you make.\n"
        "Never give personal legal advice.\n"
        "Current time: {ts}",
        lambda i: {"ts": f"2025-06-14T09:{i * 7 % 60:02d}:{i * 13 % 60:02d}Z"},
    ),
    Case(
        "customer-name-middle-sentence",
        "You are the concierge for Harbor Bank's premium clients. The customer you are "
        "helping is {name}. Greet them by name once, then answer from the account documents "
        "below. Keep a warm, professional tone and never mention other clients.",
        lambda i: {"name": NAMES[i]},
    ),
    Case(
        "name-tier-year-one-sentence",
        "You are Lumen, a shopping assistant for an online furniture store.\n"
        "The signed-in user is {name}, a {tier} member since {year}.\n"
        "Recommend only products listed in the catalog excerpts.\n"
        "Never reveal internal discount codes.",
        lambda i: {"name": NAMES[i], "tier": TIERS[i % 4], "year": str(2015 + i)},
    ),
    Case(
        "request-id-first-line",
        "Request ID: {rid}\n"
        "You are an internal IT helpdesk bot for Contoso.\n"
        "Only answer questions about company laptops, VPN access and password resets.\n"
        "Escalate anything about payroll to the HR team.",
        lambda i: {"rid": f"req_{(i * 7919 + 1234) % 100000:05d}-{chr(97 + i)}{i * 3}"},
    ),
    Case(
        "tool-list-line",
        "You are an agent that can call tools to help the user.\n"
        "Available tools: {tools}.\n"
        "Call at most one tool per step and explain why before calling it.\n"
        "If no tool applies, answer directly from the context.",
        lambda i: {"tools": ", ".join(TOOL_SETS[i])},
    ),
    Case(
        "locale-in-parentheses",
        "You are a travel assistant for Skyway Airlines. Reply in the user's locale "
        "({locale}) and format dates and currencies for it. Do not promise refunds; point "
        "to the fare rules in the documents instead.",
        lambda i: {"locale": LOCALES[i]},
    ),
    Case(
        "version-number",
        "You are the release-notes assistant for the Quill text editor.\n"
        "The current stable version is v{ver}.\n"
        "When users ask about a feature, say in which version it was added, using the "
        "changelog excerpts.\n"
        "If a feature is not in the changelog, say that it is not documented.",
        lambda i: {"ver": f"2.3.{i + 1}"},
    ),
    Case(
        "price-and-drink",
        "You are the ordering assistant for Brew and Bean coffee house.\n"
        "Today's special is the {drink} at ${price} per cup.\n"
        "Mention the special only if the customer asks about drinks.\n"
        "Answer allergen questions only from the ingredient sheets.",
        lambda i: {"drink": DRINKS[i % len(DRINKS)], "price": f"{3 + i * 0.25:.2f}"},
    ),
    Case(
        "two-decimals-one-sentence",
        "You are a lab assistant for an introductory chemistry course. The lab temperature "
        "is {temp} degrees Celsius and the humidity is {hum} percent. Use these readings "
        "when students ask about reaction conditions. Always remind students to wear goggles.",
        lambda i: {"temp": f"{21.5 + i * 0.3:.1f}", "hum": f"{40.25 + i:.2f}"},
    ),
    Case(
        "several-lines",
        "You are Atlas, a scheduling assistant.\n"
        "User: {name}\n"
        "Timezone: {tz}\n"
        "Local time: {time}\n"
        "Book meetings only inside working hours and confirm every booking in one sentence.",
        lambda i: {"name": NAMES[i], "tz": ZONES[i], "time": f"{8 + i:02d}:{i * 11 % 60:02d}"},
    ),
    Case(
        "question-mark-last-sentence",
        "You are a quiz host for a trivia night at the city library. Ask one question at a "
        "time and wait for the answer. Keep score for each team. Is tonight's theme {theme}?",
        lambda i: {"theme": THEMES[i]},
    ),
    Case(
        "exclamation-inside-quotes",
        "You are Pip, a cheerful onboarding guide for new employees! Open with the welcome "
        'message "Welcome aboard, {name}!" Then answer questions about benefits using the '
        "handbook excerpts only.",
        lambda i: {"name": NAMES[i]},
    ),
    Case(
        "version-and-date-one-sentence",
        "You are the API support bot for Meridian Cloud. The API is at version {ver}, "
        "released on {date}, and the deprecated endpoints are listed in the migration guide. "
        "Answer with code samples in Python when helpful.\nNever share API keys.",
        lambda i: {"ver": f"v{4 + i // 4}.{i % 4}.{i * 3}", "date": f"2025-0{1 + i}-15"},
    ),
    Case(
        "balance-and-date-trailing-newline",
        "You are a budgeting assistant for a personal finance app.\n"
        "The user's checking balance is ${balance} as of {date}.\n"
        "Suggest savings only from the tips in the provided articles.\n",
        lambda i: {"balance": f"{1234.56 + i * 101.5:,.2f}", "date": f"May {i + 3}, 2025"},
    ),
    Case(
        "session-and-clock-first-sentence",
        "Session {sid} started at {time}. You are a museum guide for the Rijksmuseum "
        "collection. Describe paintings using only the catalog entries provided, and keep "
        "every answer under 120 words.",
        lambda i: {"sid": f"S-{4096 + i * 37}", "time": f"14:{i * 5:02d}:{i * 9 % 60:02d}"},
    ),
    Case(
        "markdown-bullet-lines",
        "# Role\n"
        "You are a triage assistant for Saint Mary's clinic.\n"
        "# Patient\n"
        "- Age: {age}\n"
        "- Reported symptoms: {symptoms}\n"
        "# Rules\n"
        "- Never diagnose.\n"
        "- Tell the patient to call emergency services for chest pain.\n",
        lambda i: {"age": str(23 + i * 6), "symptoms": SYMPTOMS[i]},
    ),
    # -- Chinese (no spaces, full-width punctuation) --------------------------------------
    Case(
        "zh-date-first-sentence",
        "今天是{date}。你是星河银行的智能客服，只根据提供的文档回答问题。"
        "如果文档中没有答案，请直接说明，并建议用户拨打客服热线。",
        lambda i: {"date": f"2025年3月{i + 1}日"},
    ),
    Case(
        "zh-name-and-tier-middle",
        "你是一名旅行顾问，负责为用户规划行程。当前用户是{name}，会员等级为{tier}。"
        "请只推荐文档中列出的酒店和航班。回答要简洁，不要编造价格！",
        lambda i: {"name": CN_NAMES[i], "tier": CN_TIERS[i % 3]},
    ),
    Case(
        "zh-request-id-last-line",
        "你是公司内部的IT帮助机器人。\n只回答关于电脑、VPN和密码重置的问题。\n"
        "工资相关的问题请转给人事部。\n请求编号：{rid}",
        lambda i: {"rid": f"REQ-2025{i * 311 + 1000:04d}"},
    ),
    Case(
        "zh-version-and-date",
        "你是Quill编辑器的发布说明助手。当前稳定版本是v{ver}，发布于{date}。"
        "用户问某个功能时，请根据更新日志说明它是在哪个版本加入的！"
        "如果更新日志中没有该功能，请说明没有记录。",
        lambda i: {"ver": f"2.3.{i + 1}", "date": f"2025年{i + 1}月8日"},
    ),
    Case(
        "zh-price-decimal",
        "你是咖啡店的点单助手。今日特价饮品是{drink}，每杯{price}元。"
        "只有在顾客询问饮品时才提及特价。过敏原问题只能根据配料表回答。",
        lambda i: {"drink": CN_DRINKS[i % len(CN_DRINKS)], "price": f"{12.5 + i * 0.5:.1f}"},
    ),
    Case(
        "zh-several-lines",
        "你是日程安排助手。\n用户：{name}\n时区：{tz}\n当前时间：{time}\n"
        "只在工作时间内安排会议，并用一句话确认每次预约。",
        lambda i: {"name": CN_NAMES[i], "tz": ZONES[i], "time": f"{9 + i}:{i * 7 % 60:02d}"},
    ),
    Case(
        "zh-question-last-sentence",
        "你是图书馆知识竞赛的主持人。每次只问一个问题，并等待回答。请为每个队伍记分。"
        "今晚的主题是{theme}吗？",
        lambda i: {"theme": CN_THEMES[i]},
    ),
    Case(
        "zh-tool-list",
        "你是一个可以调用工具的智能体。可用工具：{tools}。"
        "每一步最多调用一个工具，调用前先说明原因。如果没有合适的工具，请直接根据上下文回答！",
        lambda i: {"tools": "、".join(TOOL_SETS[i])},
    ),
]
CASE_IDS = [case.name for case in CASES]


def test_the_prompt_set_is_varied_enough():
    chinese = [case for case in CASES if case.name.startswith("zh-")]
    assert len(CASES) >= 20 and len(chinese) >= 6
    for case in CASES:  # the values change on every request, so every version is novel
        assert len({case.text(i) for i in range(VERSIONS)}) == VERSIONS, case.name
    for case in chinese:
        assert " " not in case.template and "。" in case.template


@pytest.fixture(scope="module")
def smollm2():
    """The real SmolLM2 tokenizer, loaded once for this module."""
    from transformers import AutoTokenizer

    from ragkv.cache_engine import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path(progress=False))


@pytest.fixture(params=["smollm2", "local"])
def tokenizer(request):
    """The real tokenizer, and the small byte-level BPE (different token seams)."""
    return request.getfixturevalue("smollm2" if request.param == "smollm2" else "local_tokenizer")


def _value_spans(template: str, values: dict[str, str]) -> list[tuple[str, int, int]]:
    """Each substituted value's (text, start, end) in the formatted prompt, found here
    independently of the library."""
    spans = []
    pos = 0
    for literal, name, spec, _conversion in string.Formatter().parse(template):
        pos += len(literal)
        if name is not None:
            text = format(values[name], spec or "")
            spans.append((text, pos, pos + len(text)))
            pos += len(text)
    return spans


def _cuts_a_word(text: str, pos: int) -> bool:
    """A cut inside a word or a number: strictly between two characters, neither of them
    whitespace, and not right after a newline or a CJK sentence end (a stricter test than
    :func:`is_boundary`, written without it)."""
    if pos <= 0 or pos >= len(text):
        return False
    before, after = text[pos - 1], text[pos]
    return not (before.isspace() or after.isspace() or before in "。？！")


# -- SystemPrompt: the caller marks the values ----------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("request_no", [0, VERSIONS - 1])
def test_system_prompt_parts_cut_on_text_boundaries(case, request_no):
    values = case.values(request_no)
    prompt = case.prompt(request_no)
    full = case.text(request_no)
    parts = prompt.parts()
    assert str(prompt) == full
    assert "".join(p.text if isinstance(p, Volatile) else p for p in parts) == full
    assert all(p.text if isinstance(p, Volatile) else p for p in parts)  # no empty part

    volatile = []
    pos = 0
    for part in parts:
        size = len(part.text if isinstance(part, Volatile) else part)
        assert is_boundary(full, pos) and is_boundary(full, pos + size), (case.name, part)
        assert not _cuts_a_word(full, pos) and not _cuts_a_word(full, pos + size)
        if isinstance(part, Volatile):
            volatile.append((pos, pos + size))
        pos += size
    assert volatile, case.name
    # Stable and volatile parts alternate: two volatile parts in a row would be one sentence.
    kinds = [isinstance(p, Volatile) for p in parts]
    assert all(a != b for a, b in zip(kinds, kinds[1:], strict=False))

    for text, start, end in _value_spans(case.template, values):
        holders = [(s, e) for s, e in volatile if s <= start and end <= e]
        assert holders, f"{case.name}: value {text!r} is not inside a volatile part"
        # The whole sentence or line moves, label included: from the sentence start on.
        assert holders[0][0] <= last_boundary(full, start), (case.name, text)


# -- The learned route: a plain string that changes on every request ------------------------


def _learned_pieces(tokenizer, case: Case):
    """Feed VERSIONS versions; return (version text, head, moved, tail) of the last plan."""
    asm = Assembler(tokenizer, block_size=16)
    for i in range(VERSIONS):
        plan = asm.assemble(system=case.text(i), chunks=CHUNKS, question=f"Question {i}?")
    version = case.text(VERSIONS - 1)
    chunks = plan.spans(SegmentKind.CHUNK)
    chunk_start, chunk_end = chunks[0].start, chunks[-1].end
    systems = plan.spans(SegmentKind.SYSTEM)
    assert plan.stats.demoted == ("system",), (case.name, plan.stats.choice_reason)
    kept = [s for s in systems if not s.demoted]
    moved = [s for s in systems if s.demoted]
    assert len(moved) == 1 and len(kept) <= 2, case.name
    assert all(s.stability is Stability.STATIC and s.end <= chunk_start for s in kept)
    assert moved[0].stability is Stability.VOLATILE and moved[0].start >= chunk_end

    def decode(span):
        return tokenizer.decode(plan.token_ids[span.start : span.end])

    kept_texts = [decode(s) for s in kept]
    moved_text = decode(moved[0])
    if len(kept_texts) == 2:
        head, tail = kept_texts
    elif len(kept_texts) == 1 and version == kept_texts[0] + moved_text:
        head, tail = kept_texts[0], ""
    elif len(kept_texts) == 1:
        head, tail = "", kept_texts[0]
    else:
        head = tail = ""
    return version, head, moved_text, tail


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_learned_split_cuts_on_text_boundaries(tokenizer, case):
    version, head, moved, tail = _learned_pieces(tokenizer, case)
    assert head + moved + tail == version, case.name  # byte for byte, in the original order
    assert head or tail, f"{case.name}: nothing stable was kept in front"
    assert moved.strip(), case.name
    for pos in (len(head), len(head) + len(moved)):
        assert is_boundary(version, pos), (case.name, version[:pos][-20:], version[pos:][:20])
        assert not _cuts_a_word(version, pos), (case.name, version[:pos][-20:])
    for text, _, _ in _value_spans(case.template, case.values(VERSIONS - 1)):
        assert text in moved, f"{case.name}: changing value {text!r} did not move"


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.name in {"customer-name-middle-sentence", "zh-price-decimal"}]
)
def test_a_learned_split_matches_the_marked_sentence(smollm2, case):
    """Where one sentence changes, learning finds the same sentence the caller would mark."""
    _, _, moved, _ = _learned_pieces(smollm2, case)
    marked = [p.text for p in case.prompt(VERSIONS - 1).parts() if isinstance(p, Volatile)]
    assert [moved.strip()] == [m.strip() for m in marked]


# -- is_boundary, last_boundary, next_boundary ----------------------------------------------


def _boundaries(text: str) -> list[int]:
    return [pos for pos in range(len(text) + 1) if is_boundary(text, pos)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3.14", [0, 4]),  # never inside a number
        ("v1.2", [0, 4]),  # never inside a version
        ("v2.3.1", [0, 6]),
        ("$3.50", [0, 5]),
        ("2026-12-05", [0, 10]),
        ("end.\nNext", [0, 4, 5, 9]),  # before and after the newline
        ("It is 9. Rules", [0, 8, 9, 14]),  # anywhere in the whitespace after the end
        ("Done!  Next", [0, 5, 6, 7, 11]),
        ("Why? Because", [0, 4, 5, 12]),
        ("end.Next", [0, 8]),  # no whitespace after the terminator: not a sentence end
        ("Is it?No", [0, 8]),
        ("a\nb", [0, 2, 3]),  # after a newline, whatever precedes it
        ("no end here", [0, 11]),  # plain spaces between words are not boundaries
        ("你好。世界", [0, 3, 5]),  # after a CJK sentence end, no space needed
        ("真的？是的！好", [0, 3, 6, 7]),
        ("价格是3.50元，好的", [0, 11]),  # a decimal and a CJK comma: no boundary
        ('He said "Stop." Then', [0, 15, 16, 20]),  # the closing quote stays with its sentence
        ("(See above.) Next", [0, 12, 13, 17]),
        ("Stop.\u00a0Go", [0, 5, 6, 8]),  # a non-breaking space counts as whitespace
        ("Stop.\tGo", [0, 5, 6, 8]),
        ("Wait... what", [0, 7, 8, 12]),
    ],
)
def test_is_boundary(text, expected):
    assert _boundaries(text) == expected


def test_the_edges_are_always_boundaries():
    for text in ["", "x", "3.14", "你好"]:
        assert is_boundary(text, 0) and is_boundary(text, len(text))
    assert is_boundary("3.14", -1) and is_boundary("3.14", 99)


def test_an_abbreviation_an_initial_or_a_list_number_ends_no_sentence():
    """``.`` then whitespace ends a sentence, except after a common abbreviation, a single
    capital initial, or a number that starts its line (a list marker)."""
    assert _boundaries("e.g. x") == [0, 6]
    assert _boundaries("Ask Dr. Ng. Then go.") == [0, 11, 12, 20]
    assert _boundaries("J. Smith wrote it. Yes") == [0, 18, 19, 22]
    assert _boundaries("Rules:\n1. Be brief.\n2. Go") == [0, 7, 19, 20, 25]
    assert _boundaries("It costs 12. Pay now") == [0, 12, 13, 20]  # mid-line: a sentence end


def test_last_and_next_boundary_never_land_inside_a_number_or_word():
    text = "Version v2.3.1 costs $3.50. Rules follow.\nToday is 2026-12-05."
    for pos in range(len(text) + 1):
        back, forward = last_boundary(text, pos), next_boundary(text, pos)
        assert back <= pos <= forward
        assert is_boundary(text, back) and is_boundary(text, forward)
        assert not _cuts_a_word(text, back) and not _cuts_a_word(text, forward)
        assert not any(is_boundary(text, p) for p in range(back + 1, pos))
        assert not any(is_boundary(text, p) for p in range(pos, forward))
    assert last_boundary(text, text.index("3.50") + 2) == 0
    assert next_boundary(text, text.index("3.50") + 2) == text.index(" Rules")


def test_last_and_next_boundary_in_chinese():
    text = "你好。世界和平！今天是2025年3月1日"
    assert last_boundary(text, 5) == 3
    assert next_boundary(text, 4) == 8
    assert next_boundary(text, 9) == len(text)
    assert last_boundary(text, len(text) - 1) == 8


def test_last_and_next_boundary_clamp_out_of_range_positions():
    assert last_boundary("abc", 99) == 3
    assert next_boundary("abc", -5) == 0
    assert last_boundary("word", 2) == 0
    assert next_boundary("word", 2) == 4


def test_a_closing_quote_after_a_cjk_sentence_end_stays_with_its_sentence():
    text = "他说：“你好。”然后离开了。"
    end_mark = text.index("。")
    assert not is_boundary(text, end_mark + 1)  # between 。 and ”
    assert is_boundary(text, end_mark + 2)  # after ”


def test_a_volatile_chinese_quote_moves_with_its_closing_quote():
    prompt = SystemPrompt("请用这句话开场：“欢迎你，{name}！”然后只根据手册回答问题。", name="李娜")
    volatile = [p.text for p in prompt.parts() if isinstance(p, Volatile)]
    assert volatile == ["请用这句话开场：“欢迎你，李娜！”"]


def test_a_value_after_an_abbreviation_moves_with_its_label():
    prompt = SystemPrompt(
        "You are a clinic assistant. Your patient's doctor is Dr. {name}. Be brief.",
        name="Okafor",
    )
    volatile = [p.text for p in prompt.parts() if isinstance(p, Volatile)]
    assert volatile == ["Your patient's doctor is Dr. Okafor."]


def test_a_learned_chinese_quote_moves_with_its_closing_quote(smollm2):
    case = Case(
        "zh-quoted-greeting",
        "你是人事助手。请用这句话开场：“欢迎你，{name}！”然后只根据员工手册回答福利相关的问题。",
        lambda i: {"name": CN_NAMES[i]},
    )
    version, head, moved, tail = _learned_pieces(smollm2, case)
    assert head + moved + tail == version
    assert moved == "请用这句话开场：“欢迎你，黄丽！”"


def test_a_value_on_a_numbered_line_moves_with_its_number():
    prompt = SystemPrompt(
        "Rules:\n1. Be brief.\n2. The customer is {name}.\n3. Never guess.", name="Ana"
    )
    volatile = [p.text for p in prompt.parts() if isinstance(p, Volatile)]
    assert volatile == ["2. The customer is Ana.\n"]


def test_boundary_checks_do_bounded_work_on_hostile_text():
    """Each check looks back a bounded window: a megabyte of spaces after a period or of
    letters before one costs linear work, not quadratic (a tenant's system prompt must not
    stall the assembler)."""
    spaces = "End." + " " * 200_000 + "Next"
    cut = last_boundary(spaces, len(spaces) - 4)
    assert 4 <= cut <= 4 + 64 and is_boundary(spaces, cut)
    gap = "word" + " " * 200_000 + "Next"  # was 14 s at 20,000 spaces: quadratic
    assert last_boundary(gap, len(gap) - 4) == 0
    letters = "a" * 200_000 + ". Next"
    assert next_boundary(letters, 1) == 200_001
    numbered = "\n" + " " * 100 + "2. The customer"
    assert is_boundary(numbered, numbered.index(" The"))  # the number is past the window
