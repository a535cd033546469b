"""Conformance of the run RPCs a learner service shares (TrainerService, DistillService):
runs are resources with ids, an unknown id is NOT_FOUND everywhere, StartRun names what it
lacks, and ListRuns pages. No run is ever started: StartRun is only sent without its
required fields, which a conforming service refuses."""

from __future__ import annotations

from types import ModuleType

import grpc

from leap.conformance.core import CheckFailed, Context, Suite

RUN_LOOKUP_RPCS = ("GetRun", "StopRun", "ResumeRun", "StreamMetrics", "ListCheckpoints")
MAX_PAGES = 5  # enough to see pages chain; a production service may hold thousands of runs


def run_suite(service: str, messages: ModuleType, service_name: str) -> Suite:
    """The run checks for the contract whose generated module is `messages`."""
    suite = Suite(service, messages.DESCRIPTOR.services_by_name[service_name])
    for rpc in RUN_LOOKUP_RPCS:
        extra = {"no_follow": True} if rpc == "StreamMetrics" else {}  # never wait on live events
        suite.add_lookup(rpc, getattr(messages, f"{rpc}Request"), "run_id", "run", **extra)
    suite.add("StartRun without request_id and config is INVALID_ARGUMENT naming both", "StartRun",
              lambda ctx: ctx.refused("StartRun", messages.StartRunRequest(), grpc.StatusCode.INVALID_ARGUMENT,
                                      "request_id", "config"))
    suite.add("ListRuns pages with next_page_token, no run twice", "ListRuns", list_runs_pages(messages))
    suite.add_paging_rules("ListRuns", messages.ListRunsRequest)
    return suite


def list_runs_pages(messages: ModuleType):
    def check(ctx: Context) -> str:
        seen: list[str] = []
        token, pages = "", 0
        while pages < MAX_PAGES:
            reply = ctx.call("ListRuns", messages.ListRunsRequest(page_size=1, page_token=token))
            pages += 1
            if len(reply.runs) > 1:
                raise CheckFailed(f"a page of page_size 1 held {len(reply.runs)} runs")
            seen += [run.run_id for run in reply.runs]
            if len(set(seen)) != len(seen):
                raise CheckFailed(f"run {seen[-1]} came back on two pages")
            token = reply.next_page_token
            if not token:
                break
        return f"{len(seen)} runs in {pages} calls of page_size 1" + (" (stopped there)" if token else "")

    return check
