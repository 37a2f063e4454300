"""How approximate is opt-in chunk reuse? Teacher-forced KL and top-1 agreement against exact.

RAG prompts are built by the assembler (``order="retrieval"``, so the caller's chunk order
is kept) from the bench's synthetic workload questions over the demo corpus. Per question:

1. the chunks in their retrieval order are computed exactly once per setting (the chunk
   index records where each chunk's K/V lives, computed after *that* context; every
   setting runs under its own cache salt so no setting's cached blocks serve another);
2. for each of ``--orders`` rotations of the chunk order (every chunk moves and follows
   other content), the exact path generates a greedy answer of ``--answer-tokens`` tokens
   (its logits at each answer position are the reference; own cache salt, so it neither
   reuses nor feeds the blended runs);
3. the prompt + that exact answer is teacher-forced through the blended path for every
   setting (naive = ``first-k`` with k=0, then k in ``--ks``), and at every answer position
   the next-token distributions are compared: KL(exact || blend), top-1 agreement (positions
   where the exact top-1/top-2 margin is under 0.1 nat are near-ties that flip under any
   rounding: skipped from agreement, and counted), and the share of the naive-vs-exact KL
   gap closed. ``recompute share`` is the share of the reused chunks' tokens recomputed.

Prefill figures are prompt tokens (the 31 teacher-forced answer tokens excluded). TTFT is
the blended request's time to its first token, which includes computing the forced answer
tokens: compare it between settings, not with a real request's TTFT.

With ``--dataset`` (MuSiQue, ``../shared/data/musique/musique_dev.json``) the prompts are
real: the instruction, ``--passages`` passages of an example and its question. Per example
the passages are computed exactly once in their file order (the warm-up records them), then
permuted; on the permuted prompt the exact path answers greedily (the reference answer and
its logits), and every setting (exact itself, naive, first-k and deviation for each k) is
teacher-forced over that answer (KL, top-1 as above) and answers greedily (token F1 with
the exact answer after SQuAD normalisation). ``recompute_ratio`` is the share of the
passages' tokens not reused; ``ttft_ratio`` is the teacher-forced run's time to first token
over the exact one's (the same tokens forced through the exact path, in its own cache
salt; so the exact row is 1 by definition, and its KL, top-1 and F1 check that a second
exact run agrees with the reference). Blended settings run in one salt with the warm-up,
in an order where no setting's exactly cached blocks reach past where the next would copy
(naive, deviation by k then by ratio, then hybrid and first-k by ascending head).
``--deviation-ratios`` adds deviation rows with a budget relative to each chunk
(``BlendConfig("deviation", k=--ratio-floor, ratio=r)``), ``--hybrid-heads`` deviation rows
that also recompute each chunk's first ``h`` tokens (``head=h``), one per ratio. JSON: a
list of rows.

Usage::

    python benchmarks/blend_quality.py [--questions 6] [--orders 3] [--json FILE] [--plot FILE]
    python benchmarks/blend_quality.py --quick     # CI size: 1 question, 1 order, k in {0, 16}
    python benchmarks/blend_quality.py --dataset ../shared/data/musique/musique_dev.json \
        --examples 20 --json musique.json
    python benchmarks/blend_quality.py --dataset ../shared/data/musique/musique_dev.json \
        --examples 20 --ks "" --deviation-ks "" --deviation-ratios 0.15,0.25 --hybrid-heads 16
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ragkv.cache_engine import Engine, SamplingParams
from ragkv.cache_engine.chunk_reuse import BlendConfig

NEAR_TIE_NAT = 0.1
DEFAULT_KS = "4,8,16,32"  # synthetic mode; --dataset: 8,16,32
REFERENCE_SALT = "blend-quality/exact"  # the exact runs' own prefix cache and chunk index


@dataclass(slots=True)
class Setting:
    """One strategy setting's figures summed over every (question, order) prompt."""

    name: str
    strategy: str
    k: int
    ratio: float = 0.0  # a budget relative to each chunk (BlendConfig.ratio; k its floor)
    head: int = 0  # deviation: each chunk's first tokens always recomputed (BlendConfig.head)
    prompts: int = 0
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    reused_nonprefix_tokens: int = 0
    found_chunk_tokens: int = 0  # tokens of chunks found in the index (copied + recomputed)
    positions: int = 0
    skipped_near_ties: int = 0
    agree: int = 0
    kl: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    agree_all: int = 0  # top-1 agreement near-ties included (dataset rows)
    f1: list[float] = field(default_factory=list)  # greedy answer vs exact (dataset rows)

    def config(self) -> BlendConfig:
        return BlendConfig(self.strategy, k=self.k, ratio=self.ratio, head=self.head)

    def summary(self, naive_kl: float | None) -> dict[str, Any]:
        counted = self.positions - self.skipped_near_ties
        mean_kl = statistics.fmean(self.kl) if self.kl else 0.0
        return {
            "setting": self.name,
            "strategy": self.strategy,
            "k": self.k,
            "prompts": self.prompts,
            "prompt_tokens": self.prompt_tokens,
            "computed_prompt_tokens": self.computed_prompt_tokens,
            "computed_share": self.computed_prompt_tokens / max(self.prompt_tokens, 1),
            "reused_nonprefix_tokens": self.reused_nonprefix_tokens,
            "recompute_share": 1 - self.reused_nonprefix_tokens / max(self.found_chunk_tokens, 1),
            "mean_kl": mean_kl,
            "p95_kl": _quantile(self.kl, 0.95),
            "top1_agreement": self.agree / counted if counted else 1.0,
            "positions": self.positions,
            "skipped_near_ties": self.skipped_near_ties,
            "gap_closed": (1 - mean_kl / naive_kl) if naive_kl else None,
            "mean_ttft_s": statistics.fmean(self.ttft_s) if self.ttft_s else 0.0,
        }


def questions(count: int, seed: int = 0) -> list[Any]:
    """The first ``count`` distinct questions of the bench's synthetic workload."""
    from ragkv.bench.workload import SyntheticConfig, synthetic_workload

    workload = synthetic_workload(
        SyntheticConfig(requests=8 * count, topics=4 * count, timestamp=False, seed=seed)
    )
    seen, picked = set(), []
    for request in workload.requests:
        key = (request.topic, request.question)
        if key not in seen and len({c.data for c in request.chunks}) >= 3:
            seen.add(key)
            picked.append(request)
        if len(picked) == count:
            break
    return picked


def compare(exact: torch.Tensor, blend: torch.Tensor, setting: Setting) -> None:
    """Add one prompt's per-position KL and top-1 agreement (rows: answer positions)."""
    log_p = torch.log_softmax(exact.double(), dim=-1)
    log_q = torch.log_softmax(blend.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    top2 = log_p.topk(2, dim=-1).values
    near_tie = (top2[:, 0] - top2[:, 1]) < NEAR_TIE_NAT
    agree = exact.argmax(-1) == blend.argmax(-1)
    setting.kl += kl.clamp_min(0).tolist()
    setting.positions += len(kl)
    setting.skipped_near_ties += int(near_tie.sum())
    setting.agree += int((agree & ~near_tie).sum())
    setting.agree_all += int(agree.sum())


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ragkv.pipeline import Pipeline

    engine = Engine.from_pretrained(
        args.model, device=args.device, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens
    )
    pipe = Pipeline(engine, order="retrieval")  # assembly only: the caller's chunk order
    settings = [Setting("naive", "first-k", 0)] + [
        Setting(f"first-k={k}", "first-k", k) for k in args.ks if k > 0
    ]
    if args.recompute_all:  # sanity: every reused token recomputed must equal exact
        settings.append(Setting("recompute-all", "first-k", 1 << 16))
    exact_computed = exact_prompt_tokens = 0
    exact_ttft: list[float] = []
    n_answer = args.answer_tokens
    try:
        for request in questions(args.questions, args.seed):
            chunks = pipe.deduplicator.dedupe(request.chunks).chunks
            warm = pipe.prepare(request.question, chunks, system=request.system).plan
            for setting in settings:  # each setting in its own salt: see _salt
                engine.generate(
                    warm.token_ids,
                    SamplingParams(max_tokens=1),
                    chunk_spans=_spans(warm),
                    cache_salt=_salt(setting),
                )
            for shift in range(1, min(args.orders, len(chunks) - 1) + 1):
                order = chunks[shift:] + chunks[:shift]
                plan = pipe.prepare(request.question, order, system=request.system).plan
                exact = engine.generate(
                    plan.token_ids,
                    SamplingParams(max_tokens=n_answer, ignore_eos=True),
                    cache_salt=REFERENCE_SALT,
                    return_logits=True,
                )
                reference = exact.logits[-n_answer:]
                forced = plan.token_ids + exact.token_ids[:-1]
                for setting in settings:
                    before = engine.stats().prefill_tokens_computed
                    out = engine.generate(
                        forced,
                        SamplingParams(max_tokens=1),
                        chunk_spans=_spans(plan),
                        reuse=setting.config(),
                        cache_salt=_salt(setting),
                        return_logits=True,
                    )
                    computed = engine.stats().prefill_tokens_computed - before
                    setting.prompts += 1
                    setting.prompt_tokens += len(plan)
                    setting.computed_prompt_tokens += computed - (n_answer - 1)
                    setting.reused_nonprefix_tokens += out.usage.reused_nonprefix_tokens
                    setting.ttft_s.append(out.timings.ttft_s)
                    compare(reference, out.logits[-n_answer:], setting)
                    if setting.name == "naive":  # runs first: every found token is kept
                        found = out.usage.reused_nonprefix_tokens
                        exact_computed += len(plan) - out.usage.cached_tokens
                        exact_prompt_tokens += len(plan)
                    setting.found_chunk_tokens += found
                exact_ttft.append(exact.timings.ttft_s)
    finally:
        engine.close()
    naive_kl = statistics.fmean(settings[0].kl) if settings[0].kl else None
    return {
        "model": engine.model_name,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "questions": args.questions,
        "orders": args.orders,
        "answer_tokens": n_answer,
        "near_tie_nat": NEAR_TIE_NAT,
        "exact": {
            "prompt_tokens": exact_prompt_tokens,
            "computed_prompt_tokens": exact_computed,
            "mean_ttft_s": statistics.fmean(exact_ttft) if exact_ttft else 0.0,
        },
        "settings": [s.summary(naive_kl) for s in settings],
    }


DATASET_SALT = "blend-quality/dataset"  # warm-up and every blended setting
EXACT_ROW_SALT = "blend-quality/exact-row"  # the exact row's second exact run


def dataset_settings(args: argparse.Namespace) -> list[Setting]:
    """Exact, naive, deviation (k, then ratio budgets), then the settings that recompute
    each chunk's head (hybrid, first-k) by ascending head: each caches its first chunk's
    recomputed head exactly, which must not lengthen a later setting's exact prefix."""
    settings = [Setting("exact", "exact", 0), Setting("naive", "none", 0)]
    settings += [Setting(f"deviation k={k}", "deviation", k) for k in sorted(args.deviation_ks)]
    floor = args.ratio_floor
    ratios = sorted(args.deviation_ratios)
    settings += [Setting(f"deviation r={r:g}", "deviation", floor, ratio=r) for r in ratios]
    headed = [
        Setting(f"hybrid h={h} r={r:g}", "deviation", floor, ratio=r, head=h)
        for h in args.hybrid_heads
        for r in ratios
    ]
    headed += [Setting(f"first-k k={k}", "first-k", k) for k in args.ks if k > 0]
    settings += sorted(headed, key=lambda s: s.head or s.k)  # stable: hybrid first on ties
    if args.recompute_all:  # last: it caches the whole prompt exactly
        settings.append(Setting("recompute-all", "first-k", 1 << 16))
    return settings


def run_dataset(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The MuSiQue harness (module docstring): one row per setting."""
    from ragkv.bench.musique import INSTRUCTION, load_musique, token_f1
    from ragkv.pipeline import Pipeline

    examples = load_musique(args.dataset, args.examples)
    engine = Engine.from_pretrained(
        args.model, device=args.device, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens
    )
    pipe = Pipeline(engine, order="retrieval")
    settings = dataset_settings(args)
    exact_ttft: list[float] = []
    rng = random.Random(args.seed)
    greedy = SamplingParams(max_tokens=args.answer_tokens)
    try:
        for example in examples:
            passages = list(example.passages[: args.passages])
            warm = pipe.prepare(example.question, passages, system=INSTRUCTION).plan
            order = passages[:]
            if len(set(passages)) > 1:  # the first passage moves (not when all are alike)
                while order[0] == passages[0]:
                    rng.shuffle(order)
            plan = pipe.prepare(example.question, order, system=INSTRUCTION).plan
            spans = _spans(plan)
            chunk_tokens = sum(end - start for start, end in spans)
            one = SamplingParams(max_tokens=1)
            engine.generate(warm.token_ids, one, chunk_spans=_spans(warm), cache_salt=DATASET_SALT)
            exact = engine.generate(
                plan.token_ids, greedy, cache_salt=REFERENCE_SALT, return_logits=True
            )
            n = len(exact.token_ids)
            reference, forced = exact.logits[-n:], plan.token_ids + exact.token_ids[:-1]
            for setting in settings:
                is_exact = setting.strategy == "exact"
                options: dict[str, Any] = {
                    "chunk_spans": spans,
                    "cache_salt": EXACT_ROW_SALT if is_exact else DATASET_SALT,
                    "reuse": None if is_exact else setting.config(),
                }
                # forced first: the greedy run then reuses its blocks, never the reverse
                # (the greedy run's answer blocks would hide answer positions' logits)
                out = engine.generate(forced, one, return_logits=True, **options)
                answer = engine.generate(plan.token_ids, greedy, **options)
                compare(reference, out.logits[-n:], setting)
                setting.f1.append(token_f1(answer.text, exact.text))
                setting.prompts += 1
                setting.found_chunk_tokens += chunk_tokens
                setting.reused_nonprefix_tokens += out.usage.reused_nonprefix_tokens
                setting.ttft_s.append(out.timings.ttft_s)
                if is_exact:
                    exact_ttft.append(out.timings.ttft_s)
            if args.json:  # after every example: a long run leaves figures if cut short
                rows = [dataset_row(s, sum(exact_ttft)) for s in settings]
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=2)
            print(f"example {len(exact_ttft)}/{len(examples)} done", file=sys.stderr)
    finally:
        engine.close()
    return [dataset_row(s, sum(exact_ttft)) for s in settings]


def dataset_row(setting: Setting, exact_ttft_s: float) -> dict[str, Any]:
    """One JSON row of the dataset harness."""
    counted = setting.positions - setting.skipped_near_ties
    default = BlendConfig()
    return {
        "setting": setting.name,
        "default": setting.strategy != "exact" and setting.config() == default,
        "recompute_ratio": 1 - setting.reused_nonprefix_tokens / max(setting.found_chunk_tokens, 1),
        "kl": statistics.fmean(setting.kl) if setting.kl else 0.0,
        "top1": setting.agree / counted if counted else 1.0,
        "answer_f1": statistics.fmean(setting.f1) if setting.f1 else 0.0,
        "ttft_ratio": sum(setting.ttft_s) / exact_ttft_s if exact_ttft_s else 0.0,
        "strategy": setting.strategy,
        "k": setting.k,
        "ratio": setting.ratio,
        "head": setting.head,
        "examples": setting.prompts,
        "p95_kl": _quantile(setting.kl, 0.95),
        "top1_all": setting.agree_all / setting.positions if setting.positions else 1.0,
        "positions": setting.positions,
        "skipped_near_ties": setting.skipped_near_ties,
    }


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'setting':<20}{'default':>8}{'recompute':>10}{'mean KL':>9}{'top-1':>7}"
        f"{'top-1 all':>10}{'answer F1':>10}{'TTFT':>7}"
    ]
    for r in rows:
        lines.append(
            f"{r['setting']:<20}{'yes' if r['default'] else '':>8}{r['recompute_ratio']:>10.3f}"
            f"{r['kl']:>9.4f}{r['top1']:>7.3f}{r['top1_all']:>10.3f}{r['answer_f1']:>10.3f}"
            f"{r['ttft_ratio']:>7.2f}"
        )
    return "\n".join(lines)


def _salt(setting: Setting) -> str:
    """Each setting's own prefix cache and chunk index: a blended request caches the exact
    part before its first copied token, which would otherwise lengthen the next setting's
    exact prefix on the same prompt (and hide its first chunk from reuse)."""
    return f"blend-quality/{setting.name}"


def _spans(plan: Any) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in plan.spans("chunk")]


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def format_table(report: dict[str, Any]) -> str:
    exact = report["exact"]
    lines = [
        f"{report['model']} ({report['dtype']}), {report['questions']} questions x "
        f"{report['orders']} chunk orders, {report['answer_tokens']} teacher-forced answer "
        f"tokens; near-ties (< {report['near_tie_nat']} nat) skipped from agreement",
        f"{'setting':<15}{'computed':>10}{'share':>8}{'recompute':>11}{'mean KL':>10}"
        f"{'p95 KL':>9}{'top-1':>8}{'skipped':>9}{'gap closed':>12}",
        f"{'exact':<15}{exact['computed_prompt_tokens']:>10}"
        f"{exact['computed_prompt_tokens'] / max(exact['prompt_tokens'], 1):>8.2f}"
        f"{'':>11}{0.0:>10.4f}{0.0:>9.4f}{1.0:>8.3f}{'':>9}{'':>12}",
    ]
    for s in report["settings"]:
        gap = "" if s["gap_closed"] is None else f"{s['gap_closed']:.2f}"
        lines.append(
            f"{s['setting']:<15}{s['computed_prompt_tokens']:>10}{s['computed_share']:>8.2f}"
            f"{s['recompute_share']:>11.2f}{s['mean_kl']:>10.4f}{s['p95_kl']:>9.4f}"
            f"{s['top1_agreement']:>8.3f}{s['skipped_near_ties']:>9}{gap:>12}"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Pareto plot: prompt tokens computed (x) vs mean KL against exact (y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = report["settings"]
    ax.plot([s["computed_prompt_tokens"] for s in rows], [s["mean_kl"] for s in rows], "o-")
    for s in rows:
        ax.annotate(s["setting"], (s["computed_prompt_tokens"], s["mean_kl"]), fontsize=8)
    exact = report["exact"]["computed_prompt_tokens"]
    ax.plot([exact], [0.0], "s", color="black", label="exact")
    ax.set_xlabel("prompt tokens computed (all prompts)")
    ax.set_ylabel("mean KL(exact || blend), nat")
    ax.set_title(f"chunk reuse on {report['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="local HF checkpoint (default: embedded SmolLM2-135M)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-tokens", type=int, default=1 << 15)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--orders", type=int, default=3, help="chunk-order rotations per question")
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--ks", default=DEFAULT_KS, help="first-k values (naive k=0 always runs)")
    p.add_argument("--recompute-all", action="store_true", help="add the exactness sanity row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="CI size: 1 question, 1 order, k=16")
    p.add_argument("--dataset", metavar="MUSIQUE.json", help="real passages (see the docstring)")
    p.add_argument("--examples", type=int, default=20, help="--dataset: examples used")
    p.add_argument("--passages", type=int, default=5, help="--dataset: passages per prompt")
    p.add_argument("--deviation-ks", default="16,32", help="--dataset: deviation budgets k")
    p.add_argument(
        "--deviation-ratios",
        default="",
        help="--dataset: deviation budgets relative to each chunk (e.g. 0.15,0.25)",
    )
    p.add_argument(
        "--hybrid-heads",
        default="",
        help="--dataset: deviation with each chunk's first H tokens recomputed, per ratio",
    )
    p.add_argument(
        "--ratio-floor", type=int, default=BlendConfig().k, help="k of the ratio settings"
    )
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    args = p.parse_args(argv)
    if args.quick:
        args.questions, args.orders, args.ks = 1, 1, "16"
    if args.dataset and args.quick:  # CI size on real text
        args.examples, args.passages, args.ks, args.deviation_ks = 1, 3, "16", "16"
    elif args.dataset and args.ks == DEFAULT_KS:
        args.ks = "8,16,32"
    args.ks = [int(k) for k in args.ks.split(",") if k.strip()]
    args.deviation_ks = [int(k) for k in args.deviation_ks.split(",") if k.strip()]
    args.deviation_ratios = [float(r) for r in args.deviation_ratios.split(",") if r.strip()]
    args.hybrid_heads = [int(h) for h in args.hybrid_heads.split(",") if h.strip()]
    if args.hybrid_heads and not args.deviation_ratios:
        p.error("--hybrid-heads needs --deviation-ratios")
    if args.dataset and not 1 <= args.passages <= 10:
        p.error("--passages must be between 1 and 10")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | list[dict[str, Any]]:
    args = parse_args(argv)
    if args.dataset:
        rows = run_dataset(args)  # writes --json itself
        print(format_rows(rows))
        return rows
    report = run(args)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
