# SPDX-License-Identifier: Apache-2.0
"""vLLM's own scheduler, writing what it scheduled each step to a file.

The engine tests name this class in vLLM's ``scheduler_cls`` (``LLM(...,
scheduler_cls=...)`` / ``vllm serve --scheduler-cls``), so it runs inside
the engine-core process; the log's path comes from the environment variable
``STEP_LOG_PATH`` (the repository root must be on ``PYTHONPATH`` there).
One JSON object per step that scheduled any token::

    {"step": 12, "preempted": ["3"], "budget": 64, "draft_slots": 3,
     "reqs": [{"id": "0", "prompt": 130, "computed": 48, "scheduled": 32,
               "drafts": 0, "spec": 0}, ...]}

``computed``: tokens of the request computed before this step (for a new
request, the prefix-cache hit); ``scheduled``: tokens scheduled now
(vLLM's ``num_scheduled_tokens``); ``drafts``: speculative tokens the
request held when the step was scheduled; ``spec``: how many of them the
step verifies (``scheduled_spec_decode_tokens``; fewer than ``drafts`` when
the token budget cut the block, or for another reason such as the model
length); ``budget``: the step's token budget (``--max-num-batched-tokens``);
``draft_slots``: the budget vLLM charges each scheduled request on top of
its tokens, for the drafts it will fill (DSpark: k - 1; n-gram: 0).
Requests finished from outside the
scheduler (a client's abort) add ``{"aborted": {"<id>": <tokens generated>}}``.
``step_events`` reads the file back and names what happened (chunks,
chunks beside verify blocks, cut blocks, prefix hits, preemptions, aborts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

STEP_LOG_ENV = "STEP_LOG_PATH"
QUALNAME = "tests.support.step_log_scheduler.StepLogScheduler"


class StepLogScheduler(Scheduler):
    """``Scheduler`` unchanged, plus one line of ``STEP_LOG_PATH`` per step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._step_log = open(os.environ[STEP_LOG_ENV], "a", buffering=1)
        self._step = 0
        spec = self.vllm_config.speculative_config
        self._draft_slots = spec.max_num_new_slots_for_drafting if spec else 0

    def schedule(self, *args, **kwargs):
        drafts = {req.request_id: len(req.spec_token_ids) for req in self.running}
        output = super().schedule(*args, **kwargs)
        self._step += 1
        if output.total_num_scheduled_tokens == 0:
            return output
        computed = {new.req_id: new.num_computed_tokens
                    for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        reqs = [{"id": req_id,
                 "prompt": self.requests[req_id].num_prompt_tokens,
                 "computed": computed[req_id],
                 "scheduled": num_tokens,
                 "drafts": drafts.get(req_id, 0),
                 "spec": len(output.scheduled_spec_decode_tokens.get(req_id, ()))}
                for req_id, num_tokens in output.num_scheduled_tokens.items()]
        record = {"step": self._step, "reqs": reqs,
                  "preempted": sorted(output.preempted_req_ids or ()),
                  "budget": self.scheduler_config.max_num_batched_tokens,
                  "draft_slots": self._draft_slots}
        self._step_log.write(json.dumps(record) + "\n")
        return output

    def finish_requests(self, request_ids, finished_status):
        finished = super().finish_requests(request_ids, finished_status)
        if finished and finished_status == RequestStatus.FINISHED_ABORTED:
            aborted = {req.request_id: req.num_output_tokens for req in finished}
            self._step_log.write(json.dumps({"aborted": aborted}) + "\n")
        return finished


def read_steps(path: Path) -> list[dict]:
    """The log's records (steps and aborts), in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def step_events(steps: list[dict]) -> dict[str, int]:
    """Counts of what the scheduler did, from its own step records.

    ``chunks``: prefill pieces that left part of the prompt for a later step;
    ``chunks_beside_verify``: steps holding such a piece and a verify block;
    ``cut_blocks``: verify blocks scheduled with fewer drafts than the
    request held, in a step whose scheduled tokens and draft slots fill its
    token budget (the budget cut them); ``prefix_hits``: requests first scheduled with cached
    tokens; ``preemptions``: requests preempted (recompute); ``aborted``:
    requests aborted from outside (a client gone) after generating at least
    one token."""
    events = dict.fromkeys(("steps", "chunks", "chunks_beside_verify",
                            "verify_blocks", "cut_blocks", "prefix_hits",
                            "prefix_hit_tokens", "preemptions", "aborted"), 0)
    seen: set[str] = set()
    for step in steps:
        if "aborted" in step:
            events["aborted"] += sum(n > 0 for n in step["aborted"].values())
            continue
        events["steps"] += 1
        events["preemptions"] += len(step["preempted"])
        chunk = verify = False
        # vLLM charges each scheduled request its tokens plus the draft slots
        # it will fill (DSpark: k - 1) against --max-num-batched-tokens.
        charged = sum(req["scheduled"] + step.get("draft_slots", 0)
                      for req in step["reqs"])
        full = charged >= step.get("budget", float("inf"))
        for req in step["reqs"]:
            if req["computed"] + req["scheduled"] < req["prompt"]:
                events["chunks"] += 1
                chunk = True
            if req["spec"]:
                events["verify_blocks"] += 1
                verify = True
            if full and req["drafts"] and req["spec"] < req["drafts"]:
                events["cut_blocks"] += 1
            if req["id"] not in seen:
                seen.add(req["id"])
                if req["computed"]:
                    events["prefix_hits"] += 1
                    events["prefix_hit_tokens"] += req["computed"]
        events["chunks_beside_verify"] += chunk and verify
    return events


def verify_outcomes(steps: list[dict]) -> dict[int, list[tuple[int, int]]]:
    """Per request (by its index in submission order, the number before the
    ``-`` of an offline ``LLM`` request id), each verify step's (drafts
    verified, drafts accepted), in order, from a run without preemption:
    after a verify of ``s`` drafts the request's computed tokens grow by
    1 + accepted (vLLM rolls rejected drafts back). A request's last verify
    (no later step) is left out."""
    outcomes: dict[int, list[tuple[int, int]]] = {}
    last: dict[int, dict] = {}
    for step in steps:
        for req in step.get("reqs", ()):
            index = int(req["id"].split("-")[0])
            before = last.get(index)
            if before is not None and before["spec"]:
                accepted = req["computed"] - before["computed"] - before["scheduled"] \
                    + before["spec"]
                outcomes.setdefault(index, []).append((before["spec"], accepted))
            last[index] = req
    return outcomes
