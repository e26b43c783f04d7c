"""Label data for a model pair: prompts from a JSONL file, labels made group by group and cached under the
user cache dir (a rerun resumes where it stopped), and the split into training / calibration / evaluation
prompts."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tokenrouter.config import EngineConfig
from tokenrouter.engine.model_runner import ModelRunner
from tokenrouter.engine.runtime import eos_token_ids
from tokenrouter.models.sources import cache_dir, resolve_model_dir
from tokenrouter.training.labels import GroupLabels, LabelSpec, label_group, similarity

SPLITS = ("train", "calibrate", "evaluate")


def read_prompts(path: str | Path) -> list[str]:
    """One JSON object per line with a "prompt" string."""
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise ValueError(f"{path}:{n}: expected an object with a non-empty string 'prompt'")
        prompts.append(item["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


class Pair:
    """The small (first) and large (last) model of a config, loaded as bare runners, and their tokenizer."""

    def __init__(self, config: EngineConfig):
        from transformers import AutoTokenizer

        if len(config.models) < 2:
            raise ValueError("models: router training needs a config with a small and a large model")
        self.small_spec, self.large_spec = config.models[0], config.models[-1]
        torch.set_num_threads(max(s.torch_threads for s in config.models) or os.cpu_count() or 1)
        small_dir = resolve_model_dir(self.small_spec.source)
        self.tokenizer = AutoTokenizer.from_pretrained(small_dir)
        self.eos_ids = eos_token_ids(self.tokenizer)
        self.small = ModelRunner(self.small_spec, small_dir)

    @functools.cached_property
    def large(self) -> ModelRunner:
        """Loaded on first use: labels already cached need only the small model."""
        return ModelRunner(self.large_spec, resolve_model_dir(self.large_spec.source))

    def describe(self) -> dict:
        return {"small": self.small_spec.source, "large": self.large_spec.source}

    def encode(self, prompt: str) -> list[int]:
        """As the service sends a string prompt: one user message through the chat template."""
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def make_labels(pair: Pair, prompts: list[str], spec: LabelSpec, log=print,
                progress: Callable[[int], None] | None = None) -> list[GroupLabels]:
    """Labels group by group (cached); `progress` is called with the number of prompts each group adds."""
    ids = [pair.encode(p) for p in prompts]
    groups = []
    for start in range(0, len(ids), spec.group):
        chunk = ids[start:start + spec.group]
        path = _group_path(pair, spec, chunk)
        if path.is_file():
            group = GroupLabels(**torch.load(path, weights_only=True))
        else:
            group = label_group(pair.small, pair.large, chunk, pair.eos_ids, spec)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(dataclasses.asdict(group), path)
        groups.append(group)
        log(f"labels: prompts {start + len(chunk)}/{len(ids)}, positions {group.stats['positions']}, "
            f"disagreements {group.stats['disagreements']}, divergent {group.stats['divergent']}")
        if progress is not None:
            progress(len(chunk))
    return groups


def _group_path(pair: Pair, spec: LabelSpec, prompts: list[list[int]]) -> Path:
    labelling = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("query_match", "branch_batch")}
    key = json.dumps([pair.describe(), pair.small_spec.dtype, pair.large_spec.dtype, labelling, prompts])
    return cache_dir() / "labels" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.pt"


@dataclass(slots=True)
class Positions:
    """Token-level examples of some prompts, and the query-level example of each prompt."""
    features: dict[str, torch.Tensor]  # name -> [N, ...]
    labels: torch.Tensor  # [N] float
    prompt_features: dict[str, torch.Tensor]  # name -> [Q, ...]: at the first response position
    prompt_labels: torch.Tensor  # [Q] float: the small model's answer does not match the large one's
    prompts: int


def split_indices(n: int, fractions: tuple[float, float], seed: int) -> dict[str, list[int]]:
    """Prompt indices shuffled by `seed`; `fractions` of them held out for calibration and evaluation."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_cal, n_eval = (round(f * n) for f in fractions)
    if n - n_cal - n_eval < 1 or min(n_cal, n_eval) < 1:
        raise ValueError(f"prompts: {n} prompts cannot be split into train / calibrate / evaluate "
                         f"with held-out fractions {fractions}")
    return {"train": order[n_cal + n_eval:], "calibrate": order[:n_cal], "evaluate": order[n_cal:n_cal + n_eval]}


def split(groups: list[GroupLabels], spec: LabelSpec, fractions: tuple[float, float],
          seed: int) -> dict[str, Positions]:
    """Positions of the train / calibrate / evaluate prompts (see `split_indices`)."""

    items = [(g, i) for g in groups for i in range(len(g.prompts))]
    chosen = split_indices(len(items), fractions, seed)
    out = {}
    for name, picks in chosen.items():
        feats, labels, pfeats, plabels = {"hidden": [], "token_embedding": [], "topk_logprobs": []}, [], [], []
        for k in picks:
            g, i = items[k]
            rows = (g.prompt_index == i).nonzero().flatten()
            for key in feats:
                feats[key].append(getattr(g, key)[rows])
            labels.append(g.divergent[rows].float())
            pfeats.append(g.hidden[rows[:1]])
            plabels.append(float(similarity(g.small_answers[i], g.responses[i]) < spec.query_match))
        out[name] = Positions({k: torch.cat(v) for k, v in feats.items()}, torch.cat(labels),
                              {"hidden": torch.cat(pfeats)}, torch.tensor(plabels), len(picks))
    return out
