"""Calibrate any policy's threshold to a target large-model share on a pair:
`python -m tokenrouter.policies.calibrate --config PAIR.yaml --policy entropy --share 0.15`.

The policy scores the small model teacher-forced on the large model's cached responses to the training
prompts (the labels of `tokenrouter.policies.train`, made first if missing), position by position as the
engine would ask it (token-level), or once per prompt (query-level). The threshold is set on the training
and calibration prompts; share, precision and recall are reported on the held-out evaluation prompts."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

from tokenrouter.config import load_config
from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.sequence import SamplingParams, Sequence
from tokenrouter.policies import Policy, StepFeatures, make_policy, split_policy
from tokenrouter.policies.dataset import Pair, make_labels, read_prompts, split_indices
from tokenrouter.policies.fit import metrics
from tokenrouter.policies.labels import LabelSpec, forced_outputs, similarity
from tokenrouter.policies.thresholds import threshold_for_share
from tokenrouter.policies.train import add_label_arguments, label_spec


def policy_scores(policies: list[Policy], pair: Pair, prompts: list[list[int]],
                  responses: list[list[int]]) -> list[list[torch.Tensor]]:
    """Per policy, per prompt: the score at each response position (one score for a query-level policy).
    The small model runs once for all policies."""
    blocks = BlockManager(pair.small.num_blocks, pair.small.block_size)
    embed = pair.small.model.embed_tokens
    out: list[list[torch.Tensor]] = [[] for _ in policies]
    for prompt, response, (logits, hidden) in zip(prompts, responses,
                                                   forced_outputs(pair.small, blocks, prompts, responses)):
        for policy, scores in zip(policies, out):
            seq = Sequence(list(prompt), SamplingParams(), policy, "small")
            values = []
            for t in range(1 if policy.level == "query" else len(response)):
                with torch.inference_mode():
                    values.append(float(policy.scores(StepFeatures(logits[t:t + 1], hidden[t:t + 1], [seq], embed))[0]))
                seq.token_ids.append(response[t])
            scores.append(torch.tensor(values))
    return out


def calibrate(policy_texts: list[str], pair: Pair, groups, spec: LabelSpec, share: float, seed: int = 0,
              holdout: tuple[float, float] = (0.15, 0.15)) -> dict[str, dict]:
    """Each policy's threshold for `share` on the training + calibration prompts, and its held-out metrics."""
    parsed = [split_policy(text) for text in policy_texts]
    policies = [make_policy(name, **params) for name, params in parsed]
    prompts = [p for g in groups for p in g.prompts]
    responses = [r for g in groups for r in g.responses]
    token_labels = [g.divergent[g.prompt_index == i].float() for g in groups for i in range(len(g.prompts))]
    query_labels = [torch.tensor([float(similarity(a, r) < spec.query_match)])
                    for g in groups for a, r in zip(g.small_answers, g.responses)]
    chosen = split_indices(len(prompts), holdout, seed)
    results = {}
    for text, (name, params), policy, scores in zip(policy_texts, parsed, policies,
                                                     policy_scores(policies, pair, prompts, responses)):
        labels = query_labels if policy.level == "query" else token_labels
        threshold = threshold_for_share(torch.cat([scores[i] for i in chosen["train"] + chosen["calibrate"]]), share)
        held_out = metrics(torch.cat([scores[i] for i in chosen["evaluate"]]),
                           torch.cat([labels[i] for i in chosen["evaluate"]]), threshold)
        calibrated = {k: v for k, v in params.items() if k not in ("threshold", "share")}
        calibrated.update(policy.threshold_params(threshold))
        results[text] = {"policy": name + ":" + ",".join(f"{k}={v}" for k, v in calibrated.items()), "given": text,
                         "name": name, "params": calibrated, "score_threshold": threshold, "target_share": share,
                         "held_out": held_out}
    return results


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m tokenrouter.policies.calibrate", description=__doc__.split("\n\n")[0])
    add_label_arguments(p)
    p.add_argument("--policy", required=True, action="append", help="policy spec, e.g. entropy or rolling:of=logu")
    p.add_argument("--share", type=float, required=True, help="target large-model share")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write", default="", help="directory: write <policy name>.yaml policy blocks there")
    args = p.parse_args(argv)
    spec = label_spec(args)
    pair = Pair(load_config(args.config))
    groups = make_labels(pair, read_prompts(args.prompts)[:args.limit or None], spec)
    results = calibrate(args.policy, pair, groups, spec, args.share, args.seed, args.holdout)
    for r in results.values():
        h = r["held_out"]
        print(f"{r['policy']}  (held-out share {h['share']:.3f}, precision {h['precision']:.3f}, "
              f"recall {h['recall']:.3f}, AUC {h['auc']:.3f})")
        if args.write:
            write_policy_block(Path(args.write), r, args)
    return results


def write_policy_block(directory: Path, result: dict, args) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result['name']}{'-' + result['params']['of'] if 'of' in result['params'] else ''}.yaml"
    h = result["held_out"]
    header = (f"# {result['name']} calibrated to a {args.share:g} large-model share on {args.config}\n"
              f"# held-out: share {h['share']:.3f}, precision {h['precision']:.3f}, recall {h['recall']:.3f}\n"
              f"# reproduce: python -m tokenrouter.policies.calibrate --config {args.config} "
              f"--policy '{result['given']}' --share {args.share:g}\n")
    path.write_text(header + yaml.safe_dump({"policy": {"name": result["name"], "params": result["params"]}},
                                            sort_keys=False))
    return path


if __name__ == "__main__":
    main()
