"""Calibrate any policy's threshold to a target large-model share on a pair:
`python -m tokenrouter.training.calibrate --config PAIR.yaml --policy entropy --share 0.15`.

A token-level policy scores the small model teacher-forced on the large model's cached responses to the
training prompts (the labels of `tokenrouter.training.train`, made first if missing), position by position
as the engine would ask it. A query-level policy scores each task of the outcome set (`--tasks`,
`--word-problems`; `tokenrouter.training.outcomes`) once, where the engine would decide: after the prompt,
or after the small model's first k tokens of its own answer (`query-confidence:tokens=k`); with
`--query-labels match` it scores the training prompts instead. The threshold is set on the training and
calibration items; share, precision and recall are reported on the held-out evaluation items."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from tokenrouter.bench import checks, progress
from tokenrouter.config import load_config
from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.sequence import SamplingParams, Sequence
from tokenrouter.policies import Policy, StepFeatures, make_policy, split_policy
from tokenrouter.training.dataset import Pair, split_indices
from tokenrouter.training.fit import metrics
from tokenrouter.training.labels import LabelSpec, forced_outputs, similarity
from tokenrouter.training.outcomes import Outcomes, collect
from tokenrouter.policies.thresholds import threshold_for_share
from tokenrouter.training.train import add_label_arguments, check_label_args, label_spec, outcome_tasks, prompt_labels


def policy_scores(policies: list[Policy], pair: Pair, prompts: list[list[int]],
                  responses: list[list[int]]) -> list[list[torch.Tensor]]:
    """Per policy, per prompt: the score at each response position of a token-level policy; for a
    query-level one, its decision, taken after `decides_after` response tokens (-inf when the response
    ends before: the engine never asks, and the home keeps it). The small model runs once for all policies."""
    if all(p.level == "query" for p in policies):  # only the first decides_after + 1 positions are read
        keep = max(p.decides_after for p in policies) + 1
        responses = [r[:keep] for r in responses]  # (a response longer than decides_after stays so)
    blocks = BlockManager(pair.small.num_blocks, pair.small.block_size)
    embed = pair.small.model.embed_tokens
    out: list[list[torch.Tensor]] = [[] for _ in policies]
    forced = forced_outputs(pair.small, blocks, prompts, responses)
    names = ", ".join(p.describe() for p in policies)
    for prompt, response, (logits, hidden) in progress.bar(len(prompts), f"scoring {names}", "prompt",
                                                           zip(prompts, responses, forced)):
        for policy, scores in zip(policies, out):
            seq = Sequence(list(prompt), SamplingParams(), policy, "small")
            query = policy.level == "query"
            values = []
            for t in range(min(policy.decides_after + 1, len(response)) if query else len(response)):
                with torch.inference_mode():
                    values.append(float(policy.scores(StepFeatures(logits[t:t + 1], hidden[t:t + 1], [seq], embed))[0]))
                seq.token_ids.append(response[t])
            if query:
                values = values[-1:] if len(response) > policy.decides_after else [-math.inf]
            scores.append(torch.tensor(values))
    return out


@dataclass(slots=True)
class ScoringSet:
    """What a level's policies are calibrated on: prompts, the responses they read, labels per prompt."""
    prompts: list[list[int]]
    responses: list[list[int]]
    labels: list[torch.Tensor]


def token_set(groups) -> ScoringSet:
    """The training prompts, the large model's responses, divergent positions."""
    return ScoringSet([p for g in groups for p in g.prompts], [r for g in groups for r in g.responses],
                      [g.divergent[g.prompt_index == i].float() for g in groups for i in range(len(g.prompts))])


def query_set(groups=None, spec: LabelSpec | None = None, outcomes: Outcomes | None = None,
              outcome_label: str = "large-helps") -> ScoringSet:
    """Query-level items and the small model's own answers: the outcome tasks, or the training prompts
    labelled by whether the small model's answer matches the large one's."""
    if outcomes is not None:
        return ScoringSet(outcomes.prompts, outcomes.small_answers,
                          [t.reshape(1) for t in outcomes.labels(outcome_label)])
    return ScoringSet([p for g in groups for p in g.prompts], [a for g in groups for a in g.small_answers],
                      [torch.tensor([float(similarity(a, r) < spec.query_match)])
                       for g in groups for a, r in zip(g.small_answers, g.responses)])


def calibrate(policy_texts: list[str], pair: Pair, groups, spec: LabelSpec, share: float, seed: int = 0,
              holdout: tuple[float, float] = (0.15, 0.15), outcomes: Outcomes | None = None,
              outcome_label: str = "large-helps") -> dict[str, dict]:
    """Each policy's threshold for `share` on the training + calibration items, and its held-out metrics.
    Query-level policies are calibrated on `outcomes` when given, else on the prompts of `groups`."""
    parsed = [split_policy(text) for text in policy_texts]
    policies = [make_policy(name, **params) for name, params in parsed]
    sets = {"token": lambda: token_set(groups), "query": lambda: query_set(groups, spec, outcomes, outcome_label)}
    scored = {}
    for level, make in sets.items():
        picked = [i for i, p in enumerate(policies) if p.level == level]
        if picked:
            data = make()
            for i, scores in zip(picked, policy_scores([policies[i] for i in picked], pair, data.prompts,
                                                        data.responses)):
                scored[i] = (scores, data.labels, split_indices(len(data.prompts), holdout, seed))
    results = {}
    for n, (text, (name, params), policy) in enumerate(zip(policy_texts, parsed, policies)):
        scores, labels, chosen = scored[n]
        threshold = threshold_for_share(torch.cat([scores[i] for i in chosen["train"] + chosen["calibrate"]]), share)
        held_out = metrics(torch.cat([scores[i] for i in chosen["evaluate"]]),
                           torch.cat([labels[i] for i in chosen["evaluate"]]), threshold)
        calibrated = {k: v for k, v in params.items() if k not in ("threshold", "share")}
        calibrated.update(policy.threshold_params(threshold))
        results[text] = {"policy": name + ":" + ",".join(f"{k}={v}" for k, v in calibrated.items()), "given": text,
                         "name": name, "params": calibrated, "score_threshold": threshold, "target_share": share,
                         "held_out": held_out, "calibrated_on": "task outcomes" if policy.level == "query"
                         and outcomes is not None else "training prompts"}
    return results


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m tokenrouter.training.calibrate", description=__doc__.split("\n\n")[0])
    add_label_arguments(p)
    p.add_argument("--policy", required=True, action="append", help="policy spec, e.g. entropy or rolling:of=logu")
    p.add_argument("--share", type=float, required=True, help="target large-model share")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write", default="", help="directory: write <policy name>.yaml policy blocks there")
    args = p.parse_args(argv)
    checks.before_work(p, check_args, args)
    spec = label_spec(args)
    pair = Pair(load_config(args.config))
    levels = {make_policy(name, **params).level for name, params in map(split_policy, args.policy)}
    outcomes = None
    if "query" in levels and args.query_labels == "outcome":
        outcomes = collect(args.config, pair, outcome_tasks(args), args.concurrency)
    groups = None
    if "token" in levels or ("query" in levels and outcomes is None):
        groups = prompt_labels(pair, args, spec)
    results = calibrate(args.policy, pair, groups, spec, args.share, args.seed, args.holdout, outcomes,
                        args.outcome_label)
    for r in results.values():
        h = r["held_out"]
        print(f"{r['policy']}  (held-out share {h['share']:.3f}, precision {h['precision']:.3f}, "
              f"recall {h['recall']:.3f}, AUC {h['auc']:.3f})")
        if args.write:
            write_policy_block(Path(args.write), r, args)
    return results


def check_args(args: argparse.Namespace) -> None:
    """Every argument, before any model loads (raises ValueError naming the argument)."""
    levels = {p.level for p in checks.policies(args.policy, "--policy")}
    outcomes = "query" in levels and args.query_labels == "outcome"
    check_label_args(args, prompts="token" in levels or ("query" in levels and not outcomes), tasks=outcomes)
    checks.fraction(args.share, "--share")


def write_policy_block(directory: Path, result: dict, args) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    params = result["params"]
    suffix = f"-{params['of']}" if "of" in params else f"-first{params['tokens']}" if params.get("tokens") else ""
    path = directory / f"{result['name']}{suffix}.yaml"
    h = result["held_out"]
    labels = (f"task outcomes, {args.outcome_label}" if result["calibrated_on"] == "task outcomes"
              else "labels of the training prompts")
    header = (f"# {result['name']} calibrated to a {args.share:g} large-model share on {args.config}\n"
              f"# held-out ({labels}): share {h['share']:.3f}, precision {h['precision']:.3f}, "
              f"recall {h['recall']:.3f}\n"
              f"# reproduce: python -m tokenrouter.training.calibrate --config {args.config} "
              f"--policy '{result['given']}' --share {args.share:g}\n")
    path.write_text(header + yaml.safe_dump({"policy": {"name": result["name"], "params": result["params"]}},
                                            sort_keys=False))
    return path


if __name__ == "__main__":
    main()
