"""Task-outcome labels for query-level routers. Every task is answered twice through the engine, greedily,
by the small model alone and by the large model alone (as the pilot runs them); each answer is checked
(code tasks: their tests in the sandbox; word problems: the exact number), and the small model's
representation of the prompt is read (its final-norm hidden state at the last prompt position: what
`query-classifier` reads when it serves). A task is a positive when routing it to the large model pays:
by default, the large model passes where the small one fails (`large-helps`), or the small model fails
(`small-fails`). Answers are cached under the user cache dir per model, so a rerun only checks them."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenrouter.config import ModelSpec
from tokenrouter.models.sources import cache_dir

OUTCOME_LABELS = ("large-helps", "small-fails")
CHECK_WORKERS = 2


@dataclass(slots=True, frozen=True)
class OutcomeTask:
    task_id: str
    prompt: str  # sent as one user message, as the service sends a string prompt
    check: Callable[[str], bool]  # does a response solve the task?
    max_tokens: int = 512


def code_tasks(path: str | Path | None = None, split: str = "dev", max_tokens: int = 512, timeout: float = 10.0,
               memory_mb: int = 1024, unsafe_no_sandbox: bool = False) -> list[OutcomeTask]:
    """HumanEval-format tasks (default: the project's own, split `dev`, never the pilot's `heldout`),
    asked as in `bench quality` (chat mode) and checked by running their tests in the sandbox (raises
    SandboxUnavailable at once where there is none and `unsafe_no_sandbox` is not set)."""
    from tokenrouter.bench.humaneval import PROJECT_TASKS, load_tasks, request
    from tokenrouter.bench.quality import check
    from tokenrouter.bench.sandbox import isolation

    isolation(unsafe_no_sandbox)

    def checker(task):
        return lambda text: check(task, text, timeout, memory_mb, unsafe_no_sandbox).passed

    return [OutcomeTask(t.task_id, request(t)["prompt"], checker(t), max_tokens)
            for t in load_tasks(path or PROJECT_TASKS, split)]


def word_problems(n: int, seed: int = 1, max_tokens: int = 256) -> list[OutcomeTask]:
    """Arithmetic word problems (`bench.workloads.math_problems`), checked against their exact answers.
    The default seed differs from the benchmark workloads' (0), so training never sees their problems."""
    from tokenrouter.bench.workloads import is_correct, math_problems

    return [OutcomeTask(r.request_id, r.prompt, lambda text, a=r.answer: is_correct(text, a), max_tokens)
            for r in math_problems(n, seed, max_tokens)]


@dataclass(slots=True)
class Outcomes:
    """Per task: both models' answers checked, and the small model's prompt representation."""
    task_ids: list[str]
    small_passed: torch.Tensor  # [Q] bool
    large_passed: torch.Tensor  # [Q] bool
    hidden: torch.Tensor  # [Q, H] small model, last prompt position
    small_answers: list[list[int]]  # token ids of the small model's answers (query-confidence reads their start)
    prompts: list[list[int]]

    def labels(self, label: str = "large-helps") -> torch.Tensor:  # [Q] float
        if label == "large-helps":
            return (self.large_passed & ~self.small_passed).float()
        if label == "small-fails":
            return (~self.small_passed).float()
        raise ValueError(f"outcome_label: must be one of {OUTCOME_LABELS}, got {label!r}")

    def stats(self, label: str) -> dict:
        return {"tasks": len(self.task_ids), "small_pass_rate": float(self.small_passed.float().mean()),
                "large_pass_rate": float(self.large_passed.float().mean()), "label": label,
                "positive_rate": float(self.labels(label).mean())}


def answers(config_path: str | Path, tasks: list[OutcomeTask], concurrency: int = 16,
            log=print) -> dict[str, list[dict]]:
    """Each model's greedy answer to every task, alone through the engine ({"text", "token_ids", "finish"}),
    from the cache where present. Returns them under "small" and "large"."""
    from tokenrouter.config import load_config

    config = load_config(config_path)
    roles = {"small": config.models[0], "large": config.models[-1]}
    caches = {role: _AnswerCache(spec) for role, spec in roles.items()}
    missing = {role: [t for t in tasks if t not in cache] for role, cache in caches.items()}
    if any(missing.values()):
        import tokenrouter
        from tokenrouter.bench.progress import Requests, generate_batch

        with tokenrouter.serve(config_path) as svc:
            for role, todo in ((r, t) for r, t in missing.items() if t):
                policy = "all-small" if role == "small" else "all-large"
                bar = Requests(len(todo), f"outcomes: {role} model answers")
                for start in range(0, len(todo), 4 * concurrency):
                    chunk = todo[start:start + 4 * concurrency]
                    outs = generate_batch(svc, [{"prompt": t.prompt, "max_tokens": t.max_tokens} for t in chunk],
                                          concurrency, "", bar=bar, policy=policy)
                    for task, out in zip(chunk, outs):
                        if out.error:
                            raise RuntimeError(f"{role} model: task {task.task_id} failed: {out.error}")
                        caches[role].put(task, {"text": out.text, "token_ids": out.token_ids,
                                                "finish": out.finish_reason})
                    caches[role].save()
                    log(f"outcomes: {role} model answered {start + len(chunk)}/{len(todo)} tasks")
                bar.close()
    return {role: [cache.get(t) for t in tasks] for role, cache in caches.items()}


def collect(config_path: str | Path, pair, tasks: list[OutcomeTask], concurrency: int = 16, log=print) -> Outcomes:
    """Answers (cached), their checks and the small model's prompt representations, for a `Pair`."""
    if len({t.task_id for t in tasks}) != len(tasks):
        raise ValueError("tasks: task ids must be unique")
    got = answers(config_path, tasks, concurrency, log)
    with ThreadPoolExecutor(CHECK_WORKERS) as pool:
        passed = {role: torch.tensor(list(pool.map(lambda ta: ta[0].check(ta[1]["text"]), zip(tasks, rows))),
                                     dtype=torch.bool) for role, rows in got.items()}
    prompts = [pair.encode(t.prompt) for t in tasks]
    return Outcomes([t.task_id for t in tasks], passed["small"], passed["large"], prompt_hidden(pair.small, prompts),
                    [a["token_ids"] for a in got["small"]], prompts)


def prompt_hidden(runner, prompts: list[list[int]]) -> torch.Tensor:
    """The runner's final-norm hidden state at the last position of each prompt: [Q, H]."""
    from tokenrouter.engine.block_manager import BlockManager
    from tokenrouter.training.labels import forced_outputs

    blocks = BlockManager(runner.num_blocks, runner.block_size)
    with torch.inference_mode():  # a one-token "response" makes the pass output the last prompt position only
        return torch.cat([h.float().cpu() for _, h in forced_outputs(runner, blocks, prompts, [[0]] * len(prompts))])


def split(outcomes: Outcomes, label: str, fractions: tuple[float, float], seed: int) -> dict:
    """Train / calibrate / evaluate `Positions` holding only query-level examples (see `dataset.split_indices`)."""
    from tokenrouter.training.dataset import Positions, split_indices

    labels = outcomes.labels(label)
    out = {}
    for name, picks in split_indices(len(labels), fractions, seed).items():
        rows = torch.tensor(picks, dtype=torch.long)
        out[name] = Positions({}, torch.zeros(0), {"hidden": outcomes.hidden[rows]}, labels[rows], len(picks))
    return out


class _AnswerCache:
    """One JSON file per model (source, dtype): prompt and max_tokens hash -> answer."""

    def __init__(self, spec: ModelSpec):
        key = json.dumps([spec.source, spec.dtype])
        self.path = cache_dir() / "outcomes" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
        self.rows = json.loads(self.path.read_text()) if self.path.is_file() else {}

    @staticmethod
    def key(task: OutcomeTask) -> str:
        return hashlib.sha256(json.dumps([task.prompt, task.max_tokens]).encode()).hexdigest()[:24]

    def __contains__(self, task: OutcomeTask) -> bool:
        return self.key(task) in self.rows

    def get(self, task: OutcomeTask) -> dict:
        return self.rows[self.key(task)]

    def put(self, task: OutcomeTask, answer: dict) -> None:
        self.rows[self.key(task)] = answer

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.rows))
        tmp.replace(self.path)
