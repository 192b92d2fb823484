"""From scheduler-updated requests to the RequestOutputs callers see.

Holds, per user request, its completions (one per child request when
``n > 1``): detokenizer, stop strings, logprobs and metrics. Text is
cumulative; while a completion runs, the last ``len(longest stop) - 1``
characters are held back, so the visible text only ever grows even when a
stop string later turns out to straddle a step and is cut off.

Stage outputs: per-token rows a request returns (``ModelRunnerOutput.hidden_states``)
are gathered step by step and handed over once, concatenated, in the finished
output's ``multimodal_output["hidden_states"]``; a preemption drops those
gathered so far (the resumed request returns them again). A chunked
stage's outputs of a step (``multimodal_outputs``: a waveform, or this
step's chunk of one) go to that step's ``multimodal_output`` as they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.core.request import Request
from omnistage.core.runner_output import ModelRunnerOutput
from omnistage.engine.detokenizer import IncrementalDetokenizer, TokenIdsOnly, find_stop_string
from omnistage.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class CompletionState:
    """One child request and the text built from its tokens."""

    index: int
    request: Request
    detok: IncrementalDetokenizer | TokenIdsOnly
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    rows: list[torch.Tensor] = field(default_factory=list)  # per-token outputs gathered so far
    stage_outputs: dict[str, Any] = field(default_factory=dict)  # a chunked (vocoder) stage's, of the last step

    def __post_init__(self) -> None:
        params = self.request.sampling_params
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        if params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_token_ids(self, token_ids: list[int], logprobs: dict[int, float] | None, more: bool = False) -> bool:
        """Consume new tokens; True when a stop string ended the completion.
        ``more``: further tokens of this step follow, so the request's end (if
        it ended) is not applied yet."""
        ended = self.request.finished and not more
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs.get(token_ids[-1], 0.0)
        num_new = len(self.detok.add_tokens(token_ids))
        if ended:
            num_new += len(self.detok.flush())
        text = self.detok.text
        # min_tokens holds back stop strings too, as it holds back stop tokens (vLLM's rule: a stop
        # string is looked for from the token after the first min_tokens on).
        if self.stop and num_new and len(self.detok.token_ids) > self.min_tokens:
            hit = find_stop_string(text, num_new, self.stop)
            if hit is not None:
                stop, idx = hit
                self.text = text[: idx + len(stop)] if self.include_stop else text[:idx]
                self.finish_reason, self.stop_reason = "stop", stop
                return True
        if ended:
            self.finish_reason = self.request.status.finish_reason
            self.stop_reason = self.request.stop_reason
            self.text = text
        else:
            self.text = text[: max(0, len(text) - self.holdback)]
        return False

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.detok.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob,
        )


@dataclass
class RequestState:
    """A user request: its prompt, its completions and its timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[CompletionState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None  # the prompt's tokens scored so far

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def add_prompt_logprobs(self, index: int, entries: list[dict[int, float]]) -> None:
        """Entries for prompt tokens ``index, index + 1, ...``; those of tokens already scored
        (a preempted request runs its prompt again) are dropped."""
        assert self.prompt_logprobs is not None and index <= len(self.prompt_logprobs)
        self.prompt_logprobs += entries[len(self.prompt_logprobs) - index :]

    def to_output(self) -> RequestOutput:
        first = self.completions[0]
        cached = max(0, first.request.num_cached_tokens)
        self.metrics.num_cached_tokens = cached
        self.metrics.first_scheduled_time = first.request.first_scheduled_time
        self.metrics.num_draft_tokens = sum(c.request.num_draft_tokens for c in self.completions)
        self.metrics.num_accepted_tokens = sum(c.request.num_accepted_tokens for c in self.completions)
        self.metrics.num_drafts = sum(c.request.num_drafts for c in self.completions)
        out = RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.to_output() for c in self.completions],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=cached,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )
        out.multimodal_output.update(first.stage_outputs)
        if self.finished:
            if first.request.return_hidden_states:
                rows = first.rows
                states = torch.cat(rows) if len(rows) > 1 else rows[0] if rows else None
                # One row per forwarded token of the final sequence (its last token is never
                # forwarded). Speculation can verify tokens past a stop in the same step:
                # their rows go, like the tokens.
                forwarded = len(self.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
                if states is not None and states.shape[0] > forwarded:
                    states = states[:forwarded]
                out.multimodal_output["hidden_states"] = states
        return out


class OutputProcessor:
    """Per-request output state, keyed by user request id and by child id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.children: dict[str, tuple[RequestState, CompletionState]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states or request_id in self.children

    def add_request(
        self, request_id: str, prompt: str | None, children: list[Request], arrival_time: float
    ) -> RequestState:
        def detokenizer(child: Request) -> IncrementalDetokenizer | TokenIdsOnly:
            if self.tokenizer is None:
                return TokenIdsOnly()
            return IncrementalDetokenizer(self.tokenizer, child.sampling_params.skip_special_tokens)

        completions = [CompletionState(i, child, detokenizer(child)) for i, child in enumerate(children)]
        state = RequestState(
            request_id, prompt, list(children[0].prompt_token_ids), completions, RequestMetrics(arrival_time)
        )
        if children[0].sampling_params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first token has no position before it
        self.states[request_id] = state
        for c in completions:
            self.children[c.request.request_id] = (state, c)
        return state

    def pop_request(self, request_id: str) -> list[str]:
        """Forget a user request; returns the child ids still unfinished."""
        state = self.states.pop(request_id, None)
        if state is None:
            return []
        for c in state.completions:
            self.children.pop(c.request.request_id, None)
        return [c.request.request_id for c in state.completions if not c.finished]

    def fail_request(self, request_id: str, error: str, now: float) -> tuple[RequestOutput, list[str]]:
        """End a user request that failed inside the engine: its output (finish
        reason "error" on every unfinished completion) and its child ids still
        unfinished, which the scheduler must abort."""
        state = self.states[request_id]
        unfinished = self.pop_request(request_id)
        for comp in state.completions:
            if not comp.finished:
                comp.finish_reason, comp.stop_reason = "error", None
        state.metrics.finished_time = now
        out = state.to_output()
        out.error = error
        return out, unfinished

    def parent_of(self, child_id: str) -> str | None:
        entry = self.children.get(child_id)
        return None if entry is None else entry[0].request_id

    def drop_rows(self, child_ids: Iterable[str]) -> None:
        """Forget the per-token rows gathered for preempted requests."""
        for cid in child_ids:
            entry = self.children.get(cid)
            if entry is not None:
                entry[1].rows.clear()

    def process(
        self, updated: list[Request], runner_output: ModelRunnerOutput, now: float
    ) -> tuple[list[RequestOutput], dict[str, int]]:
        """Outputs of the user requests touched this step, and the child ids
        that a stop string finished (the scheduler must still be told), each
        with how many of its step's tokens came after the stop string (a
        verified run can carry past it; those are never reported)."""
        touched: dict[str, RequestState] = {}
        stopped: dict[str, int] = {}
        for cid, rows in (runner_output.hidden_states or {}).items():
            entry = self.children.get(cid)
            if entry is not None:  # rows of a partial prefill chunk too: its request is not in ``updated``
                entry[1].rows.append(rows)
        for cid, (index, entries) in runner_output.prompt_logprobs.items():
            entry = self.children.get(cid)
            if entry is not None:  # of a partial prefill chunk too
                entry[0].add_prompt_logprobs(index, entries)
        for cid, values in (runner_output.multimodal_outputs or {}).items():
            entry = self.children.get(cid)
            if entry is not None:
                entry[1].stage_outputs = dict(values)
        for req in updated:
            entry = self.children.get(req.request_id)
            if entry is None:
                continue  # aborted meanwhile
            state, comp = entry
            if comp.finished:
                continue
            new_ids = req.output_token_ids[len(comp.detok.token_ids) :]
            if new_ids:
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
                # One logprobs entry per token (a verified run has one per emitted token;
                # the scheduler kept a prefix of them).
                per_token = runner_output.spec_logprobs.get(req.request_id)
                if per_token is None:
                    per_token = [runner_output.logprobs.get(req.request_id)] if len(new_ids) == 1 else None
                added = len(new_ids)
                if len(new_ids) > 1 and (comp.stop or per_token is not None):
                    # Several tokens in one step (speculative decoding): each is added on its
                    # own, and a stop string is looked for after each, so no token past it is reported.
                    stop, last = False, len(new_ids) - 1
                    for i, t in enumerate(new_ids):
                        if comp.add_token_ids([t], per_token[i] if per_token else None, more=i < last):
                            stop, added = True, i + 1
                            break
                else:
                    stop = comp.add_token_ids(new_ids, per_token[0] if per_token else None)
                if stop and not req.finished:
                    stopped[req.request_id] = len(new_ids) - added
            elif req.finished:
                comp.add_token_ids([], None)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                self.pop_request(state.request_id)
            outputs.append(state.to_output())
        return outputs, stopped
