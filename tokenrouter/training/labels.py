"""Routing labels for any model pair, as R2R makes them, on the project's ModelRunner (batched chunks on
the paged cache). Per prompt: the large model's greedy response; the small model teacher-forced on it
(its prediction, hidden state and top-k log-probs at every response position); where the two disagree,
both branches continued greedily by the large model for `continuation` tokens, and the position marked
divergent when the continuations differ by `criterion`. Identical and neutral positions stay small.
The small model's own greedy answer, compared with the large model's, gives the query-level label."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import torch

from tokenrouter.bench.lockstep import finished
from tokenrouter.engine.block_manager import BlockManager, KVState
from tokenrouter.engine.model_runner import Chunk, ModelRunner
from tokenrouter.engine.sampler import sample
from tokenrouter.engine.sequence import SamplingParams, Sequence
from tokenrouter.policies.router_net import topk_logprobs

CRITERIA = ("exact", "overlap")
MAX_OUTPUT_ROWS = 512  # logits rows of one teacher-forced pass ([rows, vocab] float32)


@dataclass(slots=True)
class LabelSpec:
    max_tokens: int = 64  # of the large model's response
    continuation: int = 8  # N: tokens each branch is continued for
    criterion: str = "overlap"  # exact: continuations must be equal; overlap: similarity >= min_overlap
    min_overlap: float = 0.5
    top_k: int = 16  # log-probs stored per position
    query_match: float = 0.5  # the small model's answer "matches" the large one's at this similarity
    group: int = 32  # prompts generated together
    branch_batch: int = 64  # branches continued together

    def __post_init__(self):
        for name in ("max_tokens", "continuation", "top_k", "group", "branch_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.criterion not in CRITERIA:
            raise ValueError(f"criterion: must be one of {CRITERIA}, got {self.criterion!r}")
        for name in ("min_overlap", "query_match"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}: must be in [0, 1], got {getattr(self, name)!r}")


@dataclass(slots=True)
class GroupLabels:
    """Labels of a group of prompts; position tensors are concatenated prompt by prompt."""
    prompts: list[list[int]]
    responses: list[list[int]]  # the large model's greedy responses
    small_answers: list[list[int]]  # the small model's own greedy responses
    hidden: torch.Tensor  # [P, H] small model, position by position
    token_embedding: torch.Tensor  # [P, H] small model's input embedding of its prediction
    topk_logprobs: torch.Tensor  # [P, top_k]
    predicted: torch.Tensor  # [P] the small model's argmax
    divergent: torch.Tensor  # [P] bool
    prompt_index: torch.Tensor  # [P] which prompt of the group
    stats: dict = field(default_factory=dict)


def similarity(a: list[int], b: list[int]) -> float:
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def continuations_diverge(spec: LabelSpec, reference: list[int], alternative: list[int]) -> bool:
    if spec.criterion == "exact":
        return reference != alternative
    return similarity(reference, alternative) < spec.min_overlap


def label_group(small: ModelRunner, large: ModelRunner, prompts: list[list[int]], eos_ids: set[int],
                spec: LabelSpec) -> GroupLabels:
    small_blocks = BlockManager(small.num_blocks, small.block_size)
    large_blocks = BlockManager(large.num_blocks, large.block_size)
    responses = greedy(large, large_blocks, prompts, spec.max_tokens, eos_ids, "large")
    try:
        forced = teacher_forced(small, small_blocks, prompts, [r.output_ids for r in responses], spec.top_k)
        branches = [(i, t, int(tok)) for i, f in enumerate(forced)
                    for t, tok in enumerate(f["predicted"].tolist()) if tok != responses[i].output_ids[t]]
        diverged = continue_branches(large, large_blocks, responses, branches, eos_ids, spec)
    finally:
        free(large_blocks, responses, "large")
    small_answers = greedy(small, small_blocks, prompts, spec.max_tokens, eos_ids, "small")
    free(small_blocks, small_answers, "small")
    divergent = [torch.zeros(len(f["predicted"]), dtype=torch.bool) for f in forced]
    for (i, t, _), d in zip(branches, diverged):
        divergent[i][t] = d
    cat = lambda key: torch.cat([f[key] for f in forced])  # noqa: E731
    return GroupLabels(
        prompts=[list(p) for p in prompts], responses=[r.output_ids for r in responses],
        small_answers=[s.output_ids for s in small_answers],
        hidden=cat("hidden"), token_embedding=cat("token_embedding"), topk_logprobs=cat("topk_logprobs"),
        predicted=cat("predicted"), divergent=torch.cat(divergent),
        prompt_index=torch.cat([torch.full((len(f["predicted"]),), i) for i, f in enumerate(forced)]),
        stats={"positions": sum(len(f["predicted"]) for f in forced), "disagreements": len(branches),
               "divergent": int(sum(diverged))})


def greedy(runner: ModelRunner, blocks: BlockManager, prompts: list[list[int]], max_tokens: int,
           eos_ids: set[int], name: str) -> list[Sequence]:
    """Greedy responses of a batch of prompts. Their KV stays in `blocks` under `name`: the caller frees it."""
    return generate(runner, blocks, prompts, [SamplingParams(max_tokens=max_tokens)] * len(prompts), eos_ids, name)


def generate(runner: ModelRunner, blocks: BlockManager, prompts: list[list[int]], params: list[SamplingParams],
             eos_ids: set[int], name: str) -> list[Sequence]:
    """Responses of a batch of prompts, one `params` each, drawn as the engine draws (argmax when greedy). Their
    KV stays in `blocks` under `name`: the caller frees it."""
    seqs = [Sequence(list(p), sp, None, name) for p, sp in zip(prompts, params)]
    running = list(seqs)
    while running:
        out = forward(runner, blocks, running, name)
        tokens = sample(out.logits, [s.params for s in running], [len(s.token_ids) for s in running])
        for seq, token in zip(running, tokens):
            seq.token_ids.append(token)
        running = [s for s in running if not finished(s, eos_ids)]
    return seqs


def forward(runner: ModelRunner, blocks: BlockManager, seqs: list[Sequence], model: str):
    """One step of a bare runner over everything `seqs` miss in its cache: its logits and hidden states."""
    chunks = []
    for seq in seqs:
        kv = seq.kv_at(model)
        blocks.allocate(kv, len(seq.token_ids))
        chunks.append(Chunk(seq.token_ids[kv.num_cached:], kv.num_cached, kv.block_table))
    out = runner.run(chunks)
    for seq, chunk in zip(seqs, chunks):
        seq.kv_at(model).num_cached += len(chunk.token_ids)
    return out


def free(blocks: BlockManager, seqs: list[Sequence], name: str) -> None:
    for s in seqs:
        blocks.free(s.kv_at(name))


def forced_outputs(runner: ModelRunner, blocks: BlockManager, prompts: list[list[int]], responses: list[list[int]]):
    """The model teacher-forced on each response, a few prompts per pass: yields, prompt by prompt,
    (logits [T, vocab], hidden [T, H]) where row t predicts response[t]."""
    start = 0
    while start < len(prompts):
        end, rows = start, 0
        while end < len(prompts) and (end == start or rows + len(responses[end]) <= MAX_OUTPUT_ROWS):
            rows += len(responses[end])
            end += 1
        kvs = [KVState() for _ in range(start, end)]
        chunks = []
        for kv, prompt, response in zip(kvs, prompts[start:end], responses[start:end]):
            ids = list(prompt) + response[:-1]  # the output at position len(prompt) - 1 + t predicts response[t]
            blocks.allocate(kv, len(ids))
            chunks.append(Chunk(ids, 0, kv.block_table, num_outputs=len(response)))
        try:
            out = runner.run(chunks)
        finally:
            for kv in kvs:
                blocks.free(kv)
        for offset, response in zip(out.offsets, responses[start:end]):
            yield out.logits[offset:offset + len(response)], out.hidden[offset:offset + len(response)]
        start = end


def teacher_forced(runner: ModelRunner, blocks: BlockManager, prompts: list[list[int]],
                   responses: list[list[int]], top_k: int) -> list[dict[str, torch.Tensor]]:
    """The small model's features at every response position, reading the large model's response."""
    results = []
    with torch.inference_mode():
        for logits, hidden in forced_outputs(runner, blocks, prompts, responses):
            predicted = logits.argmax(-1)
            results.append({"hidden": hidden.float().cpu(),
                            "token_embedding": runner.model.embed_tokens(predicted).float().cpu(),
                            "topk_logprobs": topk_logprobs(logits, top_k).cpu(), "predicted": predicted.cpu()})
    return results


def continue_branches(large: ModelRunner, blocks: BlockManager, responses: list[Sequence],
                      branches: list[tuple[int, int, int]], eos_ids: set[int], spec: LabelSpec) -> list[bool]:
    """For each (prompt i, position t, small token): does the large model's continuation after the small
    token diverge from its own response after position t?"""
    out: list[bool] = []
    bs = large.block_size
    for first in range(0, len(branches), spec.branch_batch):
        batch = branches[first:first + spec.branch_batch]
        seqs, shared = [], []
        for i, t, token in batch:
            base = responses[i]
            prefix = base.prompt_ids + base.output_ids[:t]
            seq = Sequence(prefix + [token], SamplingParams(max_tokens=spec.continuation + 1), None, "large")
            # NOTE: the branch reads the full blocks of its prefix from the response's cache (shared, never
            # written: they hold positions below len(prefix)) and computes the rest in blocks of its own.
            full = len(prefix) // bs
            seq.kv["large"] = KVState(base.kv_at("large").block_table[:full], full * bs)
            seqs.append(seq)
            shared.append(full)
        try:
            running = list(seqs)
            while running:
                logits = forward(large, blocks, running, "large").logits
                for seq, tok in zip(running, logits.argmax(-1).tolist()):
                    seq.token_ids.append(tok)
                running = [s for s in running
                           if s.num_output_tokens < spec.continuation and s.token_ids[-1] not in eos_ids]
        finally:
            for seq, full in zip(seqs, shared):
                blocks.free(KVState(seq.kv["large"].block_table[full:]))
        for (i, t, _), seq in zip(batch, seqs):
            reference = responses[i].output_ids[t + 1:t + 1 + spec.continuation]
            out.append(continuations_diverge(spec, reference, seq.output_ids))
    return out
