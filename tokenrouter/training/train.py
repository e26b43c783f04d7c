"""Router training for any model pair: `python -m tokenrouter.training.train --config PAIR.yaml ...`.

Labels -> split by prompt into train / calibrate / evaluate -> class-weighted training of each requested
kind -> threshold calibrated on the calibration prompts to a target large-model share or recall ->
precision / recall on the evaluation prompts -> a checkpoint with metadata, loadable as `neural:path=...`
(or probe / query-classifier). Token-level routers (neural, probe) learn R2R-style labels on `--prompts`
(cached); the query-level classifier (query) learns task outcomes (`tokenrouter.training.outcomes`: does
the large model pass a task the small one fails?) on `--tasks` and `--word-problems`, or with
`--query-labels match` whether the small model's answer to a prompt matches the large model's."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import shlex
import sys
from pathlib import Path

import torch

from tokenrouter.bench import checks, progress
from tokenrouter.bench.humaneval import PROJECT_TASKS
from tokenrouter.bench.sandbox import add_sandbox_argument
from tokenrouter.config import load_config
from tokenrouter.policies.checkpoint import ROUTERS_DIR, check_features, round_to_saved_precision, save_router
from tokenrouter.training.dataset import Pair, Positions, make_labels, read_prompts, split
from tokenrouter.training.fit import fit, metrics, probabilities
from tokenrouter.training.labels import CRITERIA, LabelSpec
from tokenrouter.training.outcomes import OUTCOME_LABELS, OutcomeTask, code_tasks, collect, word_problems
from tokenrouter.training.outcomes import split as outcome_split
from tokenrouter.policies.router_net import RouterNet
from tokenrouter.policies.thresholds import score_quantiles, threshold_for_recall, threshold_for_share

DEFAULT_PROMPTS = Path(__file__).parents[1] / "policies" / "data" / "train_prompts.jsonl"
DEFAULT_DIM = {"neural": 64, "probe": 0, "query": 0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tokenrouter.training.train", description=__doc__.split("\n\n")[0])
    add_label_arguments(p)
    p.add_argument("--kind", default="neural,probe,query", help="comma-separated: neural, probe, query")
    p.add_argument("--out", default=str(ROUTERS_DIR / "{name}-{kind}.pt"), help="checkpoint path ({name}, {kind})")
    p.add_argument("--name", default="", help="the pair's name in --out (default: the config file's stem)")
    training = p.add_argument_group("training")
    training.add_argument("--epochs", type=int, default=30)
    training.add_argument("--lr", type=float, default=1e-3)
    training.add_argument("--dim", type=int, default=-1, help="hidden width (-1: 64 for neural, 0 = linear otherwise)")
    training.add_argument("--blocks", type=int, default=2, help="residual blocks (when dim > 0)")
    training.add_argument("--seed", type=int, default=0)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--target-share", type=float, default=None, help="calibrate to this large-model share")
    target.add_argument("--target-recall", type=float, default=None, help="calibrate to this recall of positives")
    args = p.parse_args(argv)
    if args.target_share is None and args.target_recall is None:
        args.target_share = 0.15
    args.kinds = [k.strip() for k in args.kind.split(",") if k.strip()]
    checks.before_work(p, check_args, args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Every argument, before any model loads (raises ValueError naming the argument)."""
    if not args.kinds:
        raise ValueError("--kind: give at least one of neural, probe, query")
    for kind in args.kinds:
        try:
            check_features(kind)
        except ValueError as e:
            raise ValueError(f"--kind: {e}") from None
    outcomes = "query" in args.kinds and args.query_labels == "outcome"
    check_label_args(args, prompts=any(k != "query" or not outcomes for k in args.kinds), tasks=outcomes)
    checks.at_least(args.epochs, 1, "--epochs")
    checks.above(args.lr, 0, "--lr")
    checks.at_least(args.blocks, 0, "--blocks")
    target, name = (args.target_share, "--target-share") if args.target_recall is None else \
        (args.target_recall, "--target-recall")
    checks.fraction(target, name)
    try:
        args.out.format(name="n", kind="k")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"--out: only {{name}} and {{kind}} may be filled in, got {args.out!r} ({e!r})") from None


def check_label_args(args: argparse.Namespace, prompts: bool, tasks: bool) -> None:
    """The options of `add_label_arguments` (shared with calibration): the pair's config, and the prompt
    file when token-level labels are made, the outcome tasks when query-level labels are."""
    config = checks.config(args.config)
    if len(config.models) < 2:
        raise ValueError(f"--config: {args.config} has one model; routers need a small and a large one")
    if prompts:
        try:
            read_prompts(args.prompts)
        except (OSError, ValueError) as e:
            raise ValueError(f"--prompts: {e}") from None
    if tasks:
        checks.tasks(args.tasks or str(PROJECT_TASKS), args.task_split)
        checks.at_least(args.word_problems, 0, "--word-problems")
    checks.at_least(args.limit, 0, "--limit")
    if not (all(0 <= f < 1 for f in args.holdout) and sum(args.holdout) < 1):
        raise ValueError(f"--holdout: fractions in [0, 1) that leave some prompts to train on, got {args.holdout}")
    for name in ("max_tokens", "continuation", "top_k", "group", "task_max_tokens", "concurrency"):
        checks.at_least(getattr(args, name), 1, "--" + name.replace("_", "-"))
    checks.fraction(args.min_overlap, "--min-overlap")
    checks.fraction(args.query_match, "--query-match")


def add_label_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="engine config; its first model is small, its last large")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL, one {\"prompt\": ...} per line")
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0: all)")
    p.add_argument("--holdout", type=_fractions, default=(0.15, 0.15),
                   help="fractions of the prompts held out: calibrate,evaluate")
    labels = p.add_argument_group("labels")
    labels.add_argument("--max-tokens", type=int, default=64, help="length of the large model's response")
    labels.add_argument("--continuation", type=int, default=8, help="N: tokens each branch is continued for")
    labels.add_argument("--criterion", choices=CRITERIA, default="overlap")
    labels.add_argument("--min-overlap", type=float, default=0.5, help="overlap criterion: neutral at this similarity")
    labels.add_argument("--query-match", type=float, default=0.5, help="query label: small answer close enough")
    labels.add_argument("--top-k", type=int, default=16, help="top-k log-probs stored (and read by the neural router)")
    labels.add_argument("--group", type=int, default=32, help="prompts labelled together")
    outcomes = p.add_argument_group("query-level labels")
    outcomes.add_argument("--query-labels", choices=("outcome", "match"), default="outcome",
                          help="outcome: task outcomes on --tasks and --word-problems; match: on --prompts, "
                               "whether the small model's answer matches the large one's")
    outcomes.add_argument("--tasks", default="", help="HumanEval-format JSONL (default: the project's tasks)")
    outcomes.add_argument("--task-split", default="dev", help="only the tasks of this split ('' for all)")
    outcomes.add_argument("--word-problems", type=int, default=256, help="arithmetic word problems added (0: none)")
    outcomes.add_argument("--outcome-label", choices=OUTCOME_LABELS, default="large-helps",
                          help="positive: the large model passes where the small fails, or the small model fails")
    outcomes.add_argument("--task-max-tokens", type=int, default=512, help="answer length limit for code tasks")
    add_sandbox_argument(outcomes)
    outcomes.add_argument("--concurrency", type=int, default=16, help="requests in flight while answering tasks")


def label_spec(args: argparse.Namespace) -> LabelSpec:
    return LabelSpec(max_tokens=args.max_tokens, continuation=args.continuation, criterion=args.criterion,
                     min_overlap=args.min_overlap, top_k=args.top_k, query_match=args.query_match, group=args.group)


def prompt_labels(pair: Pair, args: argparse.Namespace, spec: LabelSpec) -> list:
    """The labels of the `--prompts` (cached), with a bar of the prompts labelled."""
    prompts = read_prompts(args.prompts)[:args.limit or None]
    with progress.bar(len(prompts), "labels", unit="prompt") as bar:
        return make_labels(pair, prompts, spec, progress=bar.update)


def outcome_tasks(args: argparse.Namespace) -> list[OutcomeTask]:
    tasks = code_tasks(args.tasks or None, args.task_split, args.task_max_tokens,
                       unsafe_no_sandbox=args.unsafe_no_sandbox)
    return tasks + (word_problems(args.word_problems) if args.word_problems else [])


def _fractions(text: str) -> tuple[float, float]:
    parts = tuple(float(x) for x in text.split(","))
    if len(parts) != 2:
        raise argparse.ArgumentTypeError("expected two fractions, e.g. 0.15,0.15")
    return parts


def main(argv: list[str] | None = None) -> dict[str, dict]:
    args = parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    spec = label_spec(args)
    pair = Pair(load_config(args.config))
    outcomes = "query" in args.kinds and args.query_labels == "outcome"
    data, stats = {}, {}
    if outcomes:
        found = collect(args.config, pair, outcome_tasks(args), args.concurrency)
        data["query"] = outcome_split(found, args.outcome_label, args.holdout, args.seed)
        stats["query"] = outcome_stats(data["query"], found.stats(args.outcome_label), args)
    if any(kind != "query" or not outcomes for kind in args.kinds):
        groups = prompt_labels(pair, args, spec)
        positions = split(groups, spec, args.holdout, args.seed)
        for kind in args.kinds:
            data.setdefault(kind, positions)
            stats.setdefault(kind, data_stats(positions, spec))
    name = args.name or Path(args.config).stem
    command = "python -m tokenrouter.training.train " + shlex.join(args.argv)
    results = {}
    for kind in args.kinds:
        net, history = train_router(kind, data[kind], top_k=args.top_k, dim=args.dim, blocks=args.blocks,
                                    epochs=args.epochs, lr=args.lr, seed=args.seed)
        calibrated = calibrate_router(net, kind, data[kind], args.target_share, args.target_recall)
        out = args.out.format(name=name, kind=kind)
        results[kind] = save_trained(out, net, kind, calibrated, history, pair, args.config, stats[kind], command)
        h = calibrated["held_out"]
        print(f"{kind}: threshold {calibrated['threshold']:.4f} ({calibrated['target']}); held-out share "
              f"{h['share']:.3f}, precision {h['precision']:.3f}, recall {h['recall']:.3f}, AUC {h['auc']:.3f} "
              f"on {h['examples']} examples ({h['positives']} positive) -> {out}")
    return results


def data_stats(data: dict[str, Positions], spec: LabelSpec) -> dict:
    return {"prompts": {k: v.prompts for k, v in data.items()}, "labels": dataclasses.asdict(spec),
            "positions": {k: len(v.labels) for k, v in data.items()},
            "divergent_rate": {k: float(v.labels.mean()) for k, v in data.items()},
            "query_positive_rate": {k: float(v.prompt_labels.mean()) for k, v in data.items()}}


def outcome_stats(data: dict[str, Positions], outcomes: dict, args: argparse.Namespace) -> dict:
    return {"prompts": {k: v.prompts for k, v in data.items()}, "outcomes": outcomes,
            "sources": {"tasks": args.tasks or "project tasks", "task_split": args.task_split,
                        "word_problems": args.word_problems, "task_max_tokens": args.task_max_tokens},
            "query_positive_rate": {k: float(v.prompt_labels.mean()) for k, v in data.items()}}


def train_router(kind: str, data: dict[str, Positions], top_k: int = 16, dim: int = -1, blocks: int = 2,
                 epochs: int = 30, lr: float = 1e-3, seed: int = 0) -> tuple[RouterNet, dict]:
    """A router of `kind` fitted on the training prompts' examples (the calibration prompts pick the best
    epoch), its weights rounded as the checkpoint stores them; and the training history."""
    pick = examples(kind, top_k)
    train, valid = pick(data["train"]), pick(data["calibrate"])
    torch.manual_seed(seed)
    dim = DEFAULT_DIM[kind] if dim < 0 else dim
    net = RouterNet({k: v.shape[-1] for k, v in train[0].items()}, dim, blocks if dim else 0)
    history = fit(net, train, valid, epochs=epochs, lr=lr, seed=seed, desc=f"training {kind}")
    round_to_saved_precision(net)
    return net, history


def router_scores(net: RouterNet, kind: str, positions: Positions) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's probabilities on these examples, and their labels."""
    features, labels = examples(kind, net.inputs.get("topk_logprobs", 0))(positions)
    return probabilities(net, features), labels


def calibrate_router(net: RouterNet, kind: str, data: dict[str, Positions], target_share: float | None = None,
                     target_recall: float | None = None) -> dict:
    """The threshold reaching `target_share` (or `target_recall`) on the calibration prompts, with the metrics
    there and on the evaluation prompts, beside training-free confidence at the same held-out share."""
    if (target_share is None) == (target_recall is None):
        raise ValueError("target_share, target_recall: give exactly one of them")
    cal_scores, cal_labels = router_scores(net, kind, data["calibrate"])
    if target_recall is not None:
        threshold, target = threshold_for_recall(cal_scores, cal_labels, target_recall), {"recall": target_recall}
    else:
        threshold, target = threshold_for_share(cal_scores, target_share), {"share": target_share}
    held_out = metrics(*router_scores(net, kind, data["evaluate"]), threshold)
    return {"threshold": threshold, "target": target, "score_quantiles": score_quantiles(cal_scores),
            "calibration": metrics(cal_scores, cal_labels, threshold), "held_out": held_out,
            "reference": _reference(kind, data["evaluate"], held_out["share"])}


def save_trained(path: str | Path, net: RouterNet, kind: str, calibrated: dict, history: dict, pair: Pair,
                 config: str, stats: dict, command: str) -> dict:
    """A checkpoint loadable as `<kind>:path=...`; returns its metadata."""
    meta = {"kind": kind, "pair": pair.describe(), "config": config, "features": list(net.inputs),
            "top_k": net.inputs.get("topk_logprobs", 0), **calibrated, "training": history, "data": stats,
            "created": datetime.date.today().isoformat(), "command": command}
    save_router(path, net, meta)
    return meta


def examples(kind: str, top_k: int):
    """Picks the (features, labels) a router of `kind` reads from `Positions`."""
    def pick(p: Positions) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if kind == "query":
            return p.prompt_features, p.prompt_labels
        features = {k: p.features[k] for k in check_features(kind)}
        if "topk_logprobs" in features:
            features["topk_logprobs"] = features["topk_logprobs"][:, :top_k]
        return features, p.labels
    return pick


def _reference(kind: str, evaluate: Positions, share: float) -> dict:
    """Training-free confidence (1 - top-1 probability) at the same held-out share, for comparison."""
    if kind == "query":
        return {}
    scores = 1 - evaluate.features["topk_logprobs"][:, 0].exp()
    return {"confidence": metrics(scores, evaluate.labels, threshold_for_share(scores, share))}


if __name__ == "__main__":
    main()
