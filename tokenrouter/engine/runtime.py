"""The runtime: admits requests, runs the routing program (route / send / receive) between subservers,
and finishes sequences, freeing their blocks in every model. Everything here runs on the event loop."""
from __future__ import annotations

import asyncio
import functools
import math
from itertools import chain, repeat
from operator import attrgetter

from tokenrouter.config import EngineConfig
from tokenrouter.engine.clock import now
from tokenrouter.engine.detokenizer import Detokenizer
from tokenrouter.engine.executor import Executor
from tokenrouter.engine.messages import StepResult
from tokenrouter.engine.scheduler import Batch
from tokenrouter.engine.sequence import LENGTH, STOP, FinishReason, SamplingParams, Sequence, SeqStatus, TokenRecord, abort
from tokenrouter.engine.subserver import Subserver
from tokenrouter.engine.verification import apply, judged_from
from tokenrouter.policies import Policy


TAU_EVERY = 16  # home-model steps between two choices of tau
NAN = math.nan
_aborted = attrgetter("aborted")


class EngineOverloaded(RuntimeError):
    """More requests queued than `scheduler.max_queued_requests` allows."""


class EngineFailed(RuntimeError):
    """A model step raised or a worker died: the engine finished every request it held and refuses new ones."""


class Runtime:
    def __init__(self, config: EngineConfig, executors: dict[str, Executor], tokenizer):
        self.config = config
        self.models = [m.name for m in config.models]
        self.tokenizer = tokenizer
        self.eos_ids = eos_token_ids(tokenizer)
        self.writes_text = getattr(tokenizer, "writes_text", True)  # False: no text, no detokenizer (a simulation's)
        self.subservers = {name: Subserver(name, executors[name], config.scheduler) for name in self.models}
        self.active: dict[int, Sequence] = {}
        self.tasks: list[asyncio.Task] = []
        self.throughput_model = None  # set by the service; chooses tau while fixed_tau is None
        self.fixed_tau: float | None = None
        self.written = {name: 0 for name in self.models}  # output tokens per model since the last tau update
        self.home_steps = 0  # complete rows at a sequence's home since the last tau update
        self.large_tokens_seen = 0  # tokens the large model had computed at the last tau update
        self.error: str | None = None  # set once a subserver failed; the engine then refuses all work

    def start(self) -> None:
        self.tasks = [asyncio.get_running_loop().create_task(s.run(self), name=f"subserver-{s.name}")
                      for s in self.subservers.values()]

    # ---- admission -------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, policy: Policy, stream: bool = True) -> Sequence:
        """Admit a request. `stream`: its released records also go on `seq.stream` (False: a reader that waits for
        `seq.ended` and reads `seq.records`)."""
        if self.error:
            raise EngineFailed(f"engine failed: {self.error}")
        if not prompt_ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.vocab_size
        bad = next((t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad!r} is not in [0, {vocab}), the models' vocabulary")
        if len(self.active) >= self.config.scheduler.max_queued_requests:
            raise EngineOverloaded(f"engine overloaded: {len(self.active)} requests in flight "
                                   f"(max_queued_requests={self.config.scheduler.max_queued_requests})")
        home = policy.home(self.models, prompt_ids)
        limit = self.context_limit
        if len(prompt_ids) + params.max_tokens > limit:
            raise ValueError(f"max_tokens: the prompt has {len(prompt_ids)} tokens and max_tokens is "
                             f"{params.max_tokens}, more than the {limit} tokens this engine's models can hold")
        verifier = policy.target(self.models) if policy.verifies else ""
        if verifier and policy.draft_limit + 1 > self.config.scheduler.max_num_batched_tokens:
            raise ValueError(f"policy: {policy.describe()} holds up to {policy.draft_limit} drafts, but the verifier "
                             f"judges them in one chunk of at most max_num_batched_tokens="
                             f"{self.config.scheduler.max_num_batched_tokens} tokens")
        seq = Sequence(list(prompt_ids), params, policy, home, held=policy.decides_after, verifier=verifier,
                       stream=asyncio.Queue() if stream else None, ended=asyncio.Event(),
                       detok=self.detokenizer(len(prompt_ids)))
        self.active[seq.seq_id] = seq
        self._enqueue(seq, home)
        return seq

    @functools.cached_property
    def context_limit(self) -> int:
        """Tokens one sequence may reach: the smallest context length or KV pool over the models."""
        return min(min(s.executor.info.max_model_len, s.blocks.num_blocks * s.blocks.block_size)
                   for s in self.subservers.values())

    @functools.cached_property
    def vocab_size(self) -> int:
        """Token ids every model can embed."""
        return min(s.executor.info.vocab_size for s in self.subservers.values())

    @property
    def max_tpot(self) -> float:
        """The latency bound (seconds per token) that tau is chosen under; 0 for none."""
        return self.config.scheduler.max_delay_latency_ms / 1e3

    def abort(self, seq: Sequence, detail: str = "aborted by client") -> None:
        """Abort is a flag; the subserver holding the sequence applies it at its next step boundary."""
        if not seq.finished:
            seq.aborted = detail
            self.subservers[seq.model].wake()

    def fail(self, sub: Subserver, error: BaseException) -> None:
        """A step of `sub` raised (or its worker died): record why, abort every request in flight and stop the
        other subservers."""
        self.error = f"{sub.name}: {type(error).__name__}: {error}"
        for seq in list(self.active.values()):
            self.finish(seq, abort(f"engine failed: {self.error}"))
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    def apply_aborts(self, sub: Subserver) -> None:
        waiting, running = sub.scheduler.waiting, sub.scheduler.running
        if not any(map(_aborted, chain(waiting, running))):  # most steps: none (looked for without a Python loop)
            return
        for seq in [*waiting, *running]:
            if seq.aborted:
                self.finish(seq, abort(seq.aborted))

    # ---- the routing program ---------------------------------------------------------------------
    def postprocess(self, sub: Subserver, batch: Batch, result: StepResult) -> None:
        name, stats = sub.name, sub.stats
        if name == self.models[0] and stats.steps % TAU_EVERY == 0:
            self.update_tau()
        stats.steps += 1
        stats.busy_seconds += result.seconds
        stats.forward_seconds += result.forward_seconds
        stats.batch_sizes.append(len(batch.rows))
        stats.intervals.append((result.started, result.started + result.seconds))
        accepted = result.accepted or repeat(0)  # empty: no row verified, or none failed
        errors = result.errors or repeat("")
        tolerated = result.tolerated or repeat(())
        clock = now()  # NOTE: the step's tokens are released together, at one reading of the clock
        computed = home_steps = 0
        finished, append, handoff = SeqStatus.FINISHED, self.append, self.handoff
        for seq, row, token, send, score, ok, error, kept in zip(batch.seqs, batch.rows, result.tokens, result.send,
                                                                 result.scores, accepted, errors, tolerated):
            if error:  # this sequence only: it cannot go on, the others can
                seq.aborted = error
            n = len(row.token_ids)
            seq.kv[name].num_cached += n  # the watermark moves only after the step wrote the KV (scheduled: it has one)
            seq.tokens_computed[name] = seq.tokens_computed.get(name, 0) + n
            computed += n
            if seq.aborted:
                self.finish(seq, abort(seq.aborted))
                continue
            if not row.complete:
                continue
            home = seq.home
            home_steps += name == home
            if send:
                seq.pending_score = score
                target = seq.policy.target(self.models)
                self.send(seq, target)
                if seq.policy.moves_home:  # a query-level decision: the target writes the whole response,
                    seq.home, seq.decided = target, score  # so the old home never runs the sequence again
                    sub.scheduler.drop(seq)  # and frees its blocks now
                    self.restart(seq)
            else:
                if score == score:  # not nan
                    seq.pending_score = score
                if row.verify_from:
                    self.settle(seq, judged_from(row.verify_from, row.start), ok, token, name, kept, clock)
                else:
                    append(seq, token, name, clock)
                if seq.status is finished:
                    continue
                if seq.verify_now:  # drafts wait (as many as the policy holds, or one that would finish)
                    seq.verify_now = False
                    self.send(seq, seq.verifier)
                elif name != home:
                    handoff(seq, home)  # receive: back home
        stats.tokens += computed
        stats.step_tokens.append(computed)
        self.home_steps += home_steps

    def settle(self, seq: Sequence, first: int, accepted: int, token: int, model: str, tolerated=(),
               clock: float | None = None) -> None:
        """The verifier judged the drafts from `first` on and accepted `accepted` of them (`tolerated`: offsets of
        those unlike its own choice); `token` is its own, in place of the first rejected draft or after the last
        (engine/verification.py)."""
        end = len(seq.token_ids)
        if apply(seq, first, accepted, {name: s.blocks for name, s in self.subservers.items()}, tolerated):
            self.written[seq.home] = max(0, self.written[seq.home] - (end - len(seq.token_ids)))
            self.append(seq, token, model, clock, correction=True)
        elif seq.pending_finish is not None:  # the draft that finishes the sequence was accepted
            self.finish(seq, seq.pending_finish)
        else:
            self.append(seq, token, model, clock)

    def update_tau(self) -> None:
        """Re-choose the large models' tau from the observed concurrency, large-model visits, catch-up and home
        steps per output token. NOTE: a visit writes one large token, so the share is visits per token; for a
        verifying policy the home steps per token (its drafts) and visits per token are what
        `verify_inputs(acceptance, drafts per visit)` gives from the same run, measured here for any mix of policies."""
        total = sum(self.written.values())
        if self.throughput_model is None or self.fixed_tau is not None or total == 0:
            return
        share = 1 - self.written[self.models[0]] / total
        large = self.subservers[self.models[-1]]
        visits = self.written[self.models[-1]]
        catch_up = (large.stats.tokens - self.large_tokens_seen) / visits if visits else None
        verify = any(seq.verifier for seq in self.active.values())
        choice = self.throughput_model.choose_tau(len(self.active), share, self.max_tpot, catch_up,
                                                  self.home_steps / total, verify)
        for name in self.models[1:]:
            self.subservers[name].tau = choice.tau
        self.written = dict.fromkeys(self.written, 0)
        self.home_steps = 0
        self.large_tokens_seen = large.stats.tokens

    def send(self, seq: Sequence, model: str) -> None:
        seq.handoffs += 1
        self.handoff(seq, model)

    def handoff(self, seq: Sequence, model: str) -> None:
        """Park `seq` at the model that has it, with its blocks, and queue it at `model`.

        NOTE: the hand-off invariant, the one place it is written. Before: the sender has cached every
        token but at most the last (a home that just decided to send ran the last token: its watermark is
        len(token_ids); a target that just wrote a token has not cached it: len(token_ids) - 1), and no
        model's watermark is past len(token_ids). The receiver computes token_ids[its watermark:] only (0
        if it never saw the sequence), so after its step its watermark is len(token_ids) as of the step:
        each model prefills exactly the tokens it missed. Watermarks move only in `postprocess` (forward,
        after a step wrote the KV), in the schedulers (to 0, when blocks are freed) and in the baselines'
        own loops.
        """
        n = len(seq.token_ids)
        sender = seq.kv_at(seq.model).num_cached
        assert sender >= n - 1, f"hand-off of seq {seq.seq_id}: {seq.model} cached {sender} of {n} tokens"
        for kv in seq.kv.values():
            assert kv.num_cached <= n, f"hand-off of seq {seq.seq_id}: a watermark is past its {n} tokens: {seq.kv}"
        self.subservers[seq.model].scheduler.park(seq)
        self._enqueue(seq, model)

    def _enqueue(self, seq: Sequence, model: str) -> None:
        sub = self.subservers[model]
        sub.scheduler.add(seq)
        sub.wake()

    def active_elsewhere(self, model: str) -> int:
        """Sequences ready or running at other models: the ones that may still hand off to `model`."""
        return sum(s.scheduler.num_ready for name, s in self.subservers.items() if name != model)

    def restart(self, seq: Sequence) -> None:
        """Drop the output the old home wrote while the policy read it (held back, never released): the
        new home prefills the prompt and writes the response from its first token."""
        # NOTE: tokens already released cannot be taken back: a policy that moves a request after its
        # `decides_after` tokens gets the target continuing the response instead.
        if seq.num_output_tokens == 0 or seq.streamed:
            return
        seq.discarded += seq.num_output_tokens
        seq.held = 0  # decided: the new home's tokens go to the reader as they come
        seq.settled = seq.num_prompt_tokens
        del seq.token_ids[seq.num_prompt_tokens:]
        seq.records.clear()
        seq.detok = self.detokenizer(seq.num_prompt_tokens)

    def detokenizer(self, num_prompt_tokens: int) -> Detokenizer | None:
        return Detokenizer(self.tokenizer, num_prompt_tokens) if self.writes_text else None

    # ---- tokens and finishing --------------------------------------------------------------------
    def append(self, seq: Sequence, token: int, model: str, clock: float | None = None,
               correction: bool = False) -> None:
        """`model` wrote `token` (at `clock`, default now). A verifying sequence's home writes drafts: they settle,
        reach the reader and may finish the sequence only once the verifier accepted them."""
        token_ids = seq.token_ids
        token_ids.append(token)
        self.written[model] += 1
        length = len(token_ids)
        if model != seq.home or not seq.verifier:
            seq.settled = length
        params, detok, decided = seq.params, seq.detok, seq.decided
        is_stop = token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos)
        text = "" if is_stop or detok is None else detok.step(token_ids)
        t = (now() if clock is None else clock) - seq.arrival
        record = TokenRecord(token, text, model, seq.pending_score if decided is None else decided, t, False,
                             correction)
        seq.records.append(record)
        seq.pending_score = NAN
        outputs = length - len(seq.prompt_ids)
        if outputs > seq.held:
            if seq.settled == length and seq.streamed == outputs - 1:  # most tokens: this one alone is released
                seq.streamed = outputs
                if seq.stream is not None:
                    seq.stream.put_nowait(record)
            else:
                self.release_records(seq, t)
        if is_stop or (params.stop and detok is not None and detok.find_stop(params.stop) >= 0):
            reason = STOP
        elif outputs >= params.max_tokens or length >= self.context_limit:
            reason = LENGTH
        else:  # most tokens: the sequence goes on
            drafts = length - seq.settled
            if drafts and 0 < seq.policy.draft_limit <= drafts:
                seq.verify_now = True
            return
        if length != seq.settled:  # drafts wait: the sequence finishes once they are accepted
            seq.pending_finish, seq.verify_now = reason, True
        else:
            self.finish(seq, reason)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.finished:
            return
        for sub in self.subservers.values():
            sub.scheduler.drop(seq)
            sub.executor.forget(seq)
        if seq.num_drafts:  # aborted while drafts waited: the reader gets what was settled
            seq.cut(seq.settled)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self.active.pop(seq.seq_id, None)
        self.release_records(seq)
        if seq.stream is not None:
            seq.stream.put_nowait(None)
        seq.ended.set()

    def release_records(self, seq: Sequence, t: float | None = None) -> None:
        """Put the settled records not yet released on the stream, stamped with this time (`t`, seconds since the
        request arrived: what the reader sees)."""
        if t is None:
            t = now() - seq.arrival
        settled, streamed = seq.settled - len(seq.prompt_ids), seq.streamed
        if settled > streamed:
            stream = seq.stream
            for record in seq.records[streamed:settled]:
                record.t = t
                if stream is not None:
                    stream.put_nowait(record)
            seq.streamed = settled

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()


def eos_token_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id}
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        i = tokenizer.convert_tokens_to_ids(token)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return {i for i in ids if isinstance(i, int) and i >= 0}
