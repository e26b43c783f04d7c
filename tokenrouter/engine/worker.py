"""A worker: everything that computes for one model (or one tensor-parallel rank of it). It owns the
weights and the KV cache, runs the forward pass over a step's rows, the policies of the sequences at home
and the sampler, and answers with a StepResult. It lives wherever placement puts it: on a thread of the
service process, in its own OS process, or in a Ray actor.

NOTE: per-sequence policy state (rolling / momentum windows, query-level decisions, what a
`decides_after` policy has read) lives here, in this worker's policy objects, at the sequence's home
model: a policy only ever runs at home. A query-level send moves the home for good; the new home never
consults the policy again (the driver stops asking, `Row.route`), so no state has to follow the sequence.
"""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from tokenrouter.config import ModelSpec
from tokenrouter.engine.load_threads import follow as follow_load
from tokenrouter.engine.messages import PolicyRef, StepRequest, StepResult, WorkerInfo
from tokenrouter.engine.model_runner import Chunk, ModelRunner
from tokenrouter.engine.sampler import MIN_TEMPERATURE, draw, greedy
from tokenrouter.engine.sequence import SamplingParams
from tokenrouter.engine.verification import judge, num_outputs, tolerable
from tokenrouter.models.decoder import SINGLE


class SeqView:
    """What a worker knows of a sequence: the tokens up to its watermark here (enough for the policy and
    the sampler, which read them only on a complete row), its sampling parameters and policy."""
    __slots__ = ("seq_id", "token_ids", "num_prompt_tokens", "params", "policy", "finished", "__weakref__")

    def __init__(self, seq_id: int, num_prompt_tokens: int, params: SamplingParams, policy):
        self.seq_id, self.num_prompt_tokens, self.params, self.policy = seq_id, num_prompt_tokens, params, policy
        self.token_ids: list[int] = []
        self.finished = False

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Views:
    """The sequences and policies a worker was told about, kept in step with the driver's messages."""

    def __init__(self, name: str, models: list[str]):
        self.name, self.models = name, models
        self.seqs: dict[int, SeqView] = {}
        self.policies: dict[int, object] = {}

    def apply(self, request: StepRequest) -> list[SeqView]:
        """Take in what the request adds or drops; the views of its rows, their tokens up to the step's end."""
        for ref in request.policies:
            self.policies[ref.key] = _build(ref)
        for key in request.forget_policies:
            self.policies.pop(key, None)
        for seq_id in request.forget:
            view = self.seqs.pop(seq_id, None)
            if view is not None:
                view.finished = True  # the policies' per-sequence state goes at their next sweep
        for new in request.new:
            self.seqs[new.seq_id] = SeqView(new.seq_id, new.num_prompt_tokens, new.params, self.policies[new.policy])
        views = []
        for row in request.rows:
            view = self.seqs[row.seq_id]
            # NOTE: tokens below the watermark are the ones this model cached; the chunk carries the rest
            if row.start > len(view.token_ids):
                raise RuntimeError(f"{self.name}: sequence {row.seq_id} starts at {row.start} but the worker "
                                   f"holds {len(view.token_ids)} of its tokens")
            del view.token_ids[row.start:]
            view.token_ids.extend(row.token_ids)
            views.append(view)
        return views

    def num_known(self) -> tuple[int, int]:
        """Sequences and policies this worker holds state for (tests: nothing outlives its request)."""
        return len(self.seqs), len(self.policies)


class Worker(Views):
    def __init__(self, name: str, models: list[str], spec: ModelSpec, model_dir: Path | str, tp=None):
        super().__init__(name, models)
        self.runner = ModelRunner(spec, model_dir, tp)
        self.rank = tp.rank if tp is not None else 0
        self._spin: tuple[threading.Thread, threading.Event] | None = None

    def info(self) -> WorkerInfo:
        r = self.runner
        return WorkerInfo(r.num_blocks, r.block_size, r.max_model_len, r.num_parameters, r.weight_bytes,
                          r.cfg.vocab_size, str(r.device), r.tp_size, os.getpid())

    def execute(self, request: StepRequest) -> StepResult:
        t = time.perf_counter()
        follow_load()
        views = self.apply(request)
        rows = request.rows
        if not rows:  # a message that only makes the worker forget
            return StepResult([], [], [], 0.0)
        chunks = [Chunk(r.token_ids, r.start, r.block_table,
                        num_outputs(r.verify_from, r.start, len(r.token_ids), r.complete)) for r in rows]
        before = self.runner.mark()
        out = self.runner.run(chunks)
        after = self.runner.mark()
        if self.rank:  # tensor-parallel ranks > 0 only take part in the forward pass
            return StepResult([], [], [], time.perf_counter() - t, t, forward_seconds=self.runner.elapsed(before, after))
        last = [out.offsets[i] + c.num_outputs - 1 for i, c in enumerate(chunks)]  # each row's next-token logits
        tokens: list[int | None] = [None] * len(rows)
        send, scores, accepted = [False] * len(rows), [math.nan] * len(rows), [0] * len(rows)
        kept: list[list[int]] = [[] for _ in rows]  # per row: accepted drafts the verifier would not have written
        routed = [i for i, r in enumerate(rows) if r.route]
        # NOTE: everything the host needs from the step's device tensors (scores, send decisions, greedy tokens,
        # finiteness per output row) is read back in one copy
        reads = ReadBack()
        decided = []
        for policy, group in _group_by_policy(views, routed).items():
            features = _features(out, [last[i] for i in group], [views[i] for i in group], self.runner.model.embed_tokens)
            values = policy.scores(features).float()
            decided.append((policy, group, reads.add(values), reads.add(policy.sends(values))))
        logits = out.logits
        greedy_at = reads.add(greedy(logits))
        finite_at = reads.add(logits.sum(-1).isfinite())
        reads.fetch()
        forward = self.runner.elapsed(before, after)
        for policy, group, values, decisions in decided:
            sends_here = policy.target(self.models) != self.name
            for i, decision, value in zip(group, reads[decisions], reads[values]):
                send[i], scores[i] = bool(decision) and sends_here, value
        keep = [i for i, r in enumerate(rows) if r.complete and not send[i]]
        errors = self._non_finite(reads[finite_at], keep, last, chunks)
        keep = [i for i in keep if not errors[i]]
        if keep:
            # a verifying row draws at every judged position too: the token the position's draft must equal
            index, params, positions = [], [], []
            for i in keep:
                n, m = len(views[i].token_ids), chunks[i].num_outputs
                index.extend(range(last[i] - m + 1, last[i] + 1))
                params.extend([views[i].params] * m)
                positions.extend(range(n - m + 1, n + 1))
            greedy_tokens = reads[greedy_at]
            draws = iter(draw(logits, index, params, positions, [int(greedy_tokens[x]) for x in index]))
            for i in keep:
                n, m = len(views[i].token_ids), chunks[i].num_outputs
                drafts, own = views[i].token_ids[n - m + 1:], [next(draws) for _ in range(m)]
                tolerance, tolerated = views[i].policy.tolerance, None
                if tolerance is not None and m > 1:
                    temperature = views[i].params.temperature  # greedy rows: the model's own distribution
                    tolerated = tolerable(out.logits[last[i] - m + 1:last[i]], drafts, own[:-1],
                                          temperature if temperature >= MIN_TEMPERATURE else 1.0, tolerance)
                accepted[i], tokens[i] = judge(drafts, own, tolerated)
                if tolerated:
                    kept[i] = [k for k in range(accepted[i]) if drafts[k] != own[k]]
        return StepResult(tokens, send, scores, time.perf_counter() - t, t, accepted, errors,
                          kept if any(kept) else [], forward)

    def _non_finite(self, finite: list[float], keep: list[int], last: list[int], chunks: list[Chunk]) -> list[str]:
        """Per row, why it cannot be sampled: logits that are not finite (a numerical failure of the model on
        that sequence) end its request only, never the engine. `finite`: per output row, 1 where its logits are
        all finite, read off the row's sum: one reduction, where isfinite(logits).all(-1) writes a mask as large
        (30x slower at 128 rows). NOTE: a nan or inf anywhere makes the sum nan or inf; finite logits whose sum
        overflows float32 (over 1e38 / vocab each) would count as non-finite too, and no model writes those."""
        errors = [""] * len(chunks)
        for i in keep:
            if not all(finite[last[i] - chunks[i].num_outputs + 1:last[i] + 1]):
                errors[i] = f"{self.name}: the model's logits are not finite (nan or inf) for this sequence"
        return errors

    # ---- profiling and tests: blocking control calls, never while the engine steps this model ----------
    def profile(self) -> dict:
        from tokenrouter.engine.throughput_model import profile_runner

        return asdict(profile_runner(self.runner))

    def num_threads(self) -> int:
        return torch.get_num_threads()

    def time_decode(self, batch: int = 4) -> float:
        from tokenrouter.engine.throughput_model import time_decode

        return time_decode(self.runner, batch)

    def spin_start(self, batch: int = 4) -> None:
        """Keep this model decoding on a thread of its own until `spin_stop` (to measure contention)."""
        from tokenrouter.engine.throughput_model import decode_chunks

        stop, started = threading.Event(), threading.Event()
        chunks = decode_chunks(self.runner, batch)
        threads = torch.get_num_threads()
        group = self.runner.tp or SINGLE

        def spin():
            torch.set_num_threads(threads)
            if self.runner.device.type == "cuda":  # as on the thread that built the runner (Triton's launch device)
                torch.cuda.set_device(self.runner.device)
            # NOTE: the ranks of a tensor-parallel model agree after every step whether any was told to stop, so
            # all stop after the same step: a rank that stopped alone left the others waiting in an all-reduce
            # (a start hung in measure_slowdown)
            while True:
                self.runner.run(chunks)
                started.set()
                if group.any(stop.is_set()):
                    break

        thread = threading.Thread(target=spin, name=f"spin-{self.name}", daemon=True)
        thread.start()
        started.wait()
        self._spin = (thread, stop)

    def spin_stop(self) -> None:
        if self._spin is not None:
            thread, stop = self._spin
            stop.set()
            thread.join()
            self._spin = None

    def prompt_logits(self, token_ids: list[int]) -> list[list[float]]:
        """Logits at every position of one prompt, on KV blocks from the pool's start (tests)."""
        n, bs = len(token_ids), self.runner.block_size
        chunk = Chunk(list(token_ids), 0, list(range(-(-n // bs))), num_outputs=n)
        return self.runner.run([chunk]).logits.tolist()

    def close(self) -> None:
        self.spin_stop()
        if self.runner.tp is not None:
            self.runner.tp.close()


class ReadBack:
    """1-D tensors of a step gathered for one device-to-host copy: `add` them, `fetch` once, then index the
    reader with what `add` returned for each one's values (floats; token ids < 2^24 are exact)."""

    def __init__(self):
        self._parts: list[torch.Tensor] = []
        self._values: list[list[float]] = []

    def add(self, x: torch.Tensor) -> int:
        self._parts.append(x.reshape(-1))
        return len(self._parts) - 1

    def fetch(self) -> None:
        by_device: dict[torch.device, list[int]] = {}
        for i, x in enumerate(self._parts):
            by_device.setdefault(x.device, []).append(i)
        self._values = [[] for _ in self._parts]
        for index in by_device.values():
            # NOTE: cat promotes bools and token ids to the float scores' dtype where there are any (ids < 2^24 exact)
            flat = torch.cat([self._parts[i] for i in index]).tolist()
            start = 0
            for i in index:
                n = self._parts[i].numel()
                self._values[i] = flat[start:start + n]
                start += n

    def __getitem__(self, handle: int) -> list[float]:
        return self._values[handle]


def _build(ref: PolicyRef):
    if ref.obj is not None:
        return ref.obj
    from tokenrouter.policies import make_policy

    return make_policy(ref.name, **ref.params)


def _group_by_policy(views: list[SeqView], rows: list[int]) -> dict:
    groups: dict = {}
    for i in rows:
        groups.setdefault(views[i].policy, []).append(i)
    return groups


def _features(out, index: list[int], views: list[SeqView], embed):
    from tokenrouter.policies import StepFeatures

    # NOTE: index ascends without repeats, so as many rows as the step has outputs are all of them (no gather)
    if len(index) == out.logits.shape[0]:
        return StepFeatures(out.logits, out.hidden, views, embed)
    return StepFeatures(out.logits[index], out.hidden[index], views, embed)
