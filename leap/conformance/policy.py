"""Conformance of a PolicyService: models are listed and described, Generate orders its
completions and reports one logprob per token, a seed reproduces a sample, Score gives back
Generate's logprobs, and a weight stream without commit changes nothing.

The model checked is the `model` option (`leap conformance policy ADDRESS --model NAME`),
else "policy" when loaded, else the first one listed. Weights are never committed: the
only UpdateWeights stream sent has no commit, which the contract says must apply nothing.
"""

from __future__ import annotations

import math

import grpc

from leap.conformance.core import CheckFailed, Context, Suite
from leap.policy.v1 import policy_pb2

# The weight transports beside the stream are optional: a policy that answers UNIMPLEMENTED
# gets its weights through UpdateWeights (leap.clients.transports falls back to it).
SUITE = Suite("policy", policy_pb2.DESCRIPTOR.services_by_name["PolicyService"],
              optional=("GetWeightTransports", "OpenWeightGroup", "CommitWeights"))

PROMPTS = ["Write a C++ function that applies ReLU to an array of floats.",
           "Write a C++ function that sums the rows of a matrix."]
SEED = 1234
MAX_NEW_TOKENS = 8
LOGPROB_TOLERANCE = 0.01  # nats; `logprob_tolerance` option (bf16 engines on a GPU may need more)


def discover_model(ctx: Context) -> str:
    listed = [m.name for m in ctx.call("ListModels", policy_pb2.ListModelsRequest()).models]
    wanted = ctx.options.get("model")
    if wanted:
        if wanted not in listed:
            raise CheckFailed(f"model {wanted!r} is not loaded (ListModels: {', '.join(listed) or 'none'})")
        return wanted
    if not listed:
        raise CheckFailed("no model is loaded: load one so sampling can be checked")
    return "policy" if "policy" in listed else listed[0]


def model(ctx: Context) -> str:
    return ctx.found("model", discover_model)


def sampling(n: int, **extra: object) -> policy_pb2.SamplingParams:
    return policy_pb2.SamplingParams(n=n, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=SEED, **extra)


def generate_request(ctx: Context, n: int = 2, prompts: list[str] = PROMPTS) -> policy_pb2.GenerateRequest:
    return policy_pb2.GenerateRequest(model=model(ctx), prompts=[policy_pb2.Prompt(text=p) for p in prompts],
                                      sampling=sampling(n))


def generated(ctx: Context) -> policy_pb2.GenerateResponse:
    """One seeded Generate of two prompts with n=2, shared by the checks that read it."""
    return ctx.found("generated", lambda ctx: ctx.call("Generate", generate_request(ctx)))


def current_version(ctx: Context) -> int:
    return ctx.call("GetModel", policy_pb2.GetModelRequest(name=model(ctx))).model.version


@SUITE.check("ListModels and GetModel describe the same models", "GetModel")
def models_described(ctx: Context) -> str:
    listed = ctx.call("ListModels", policy_pb2.ListModelsRequest()).models
    if not listed:
        raise CheckFailed("ListModels lists no model")
    for info in listed:
        got = ctx.call("GetModel", policy_pb2.GetModelRequest(name=info.name)).model
        if (got.name, got.vocab_size, got.tokenizer_fingerprint) != (info.name, info.vocab_size,
                                                                     info.tokenizer_fingerprint):
            raise CheckFailed(f"GetModel({info.name!r}) and ListModels disagree")
    return ", ".join(m.name for m in listed)


SUITE.add_lookup("GetModel", policy_pb2.GetModelRequest, "name", "model")


@SUITE.check("Generate n=2: completions in (prompt, sample) order, one logprob per token id", "Generate")
def generate_ordered(ctx: Context) -> str:
    reply = generated(ctx)
    order = [(c.prompt_index, c.sample_index) for c in reply.completions]
    wanted = [(i, j) for i in range(len(PROMPTS)) for j in range(2)]
    if order != wanted:
        raise CheckFailed(f"completions came as {order}, {wanted} expected")
    for c in reply.completions:
        where = f"completion ({c.prompt_index}, {c.sample_index})"
        if not c.token_ids or len(c.logprobs) != len(c.token_ids):
            raise CheckFailed(f"{where}: {len(c.token_ids)} token ids and {len(c.logprobs)} logprobs")
        if not all(math.isfinite(x) and x <= 1e-4 for x in c.logprobs):
            raise CheckFailed(f"{where}: logprobs must be finite and at most 0")
        if c.weight_version != reply.weight_version:
            raise CheckFailed(f"{where}: weight_version {c.weight_version}, the response's is {reply.weight_version}")
    return f"{len(order)} completions in order on {model(ctx)!r}"


@SUITE.check("a seed makes Generate reproducible", "Generate")
def generate_seeded(ctx: Context) -> str:
    first = generated(ctx)
    again = ctx.call("Generate", generate_request(ctx))
    if [list(c.token_ids) for c in again.completions] != [list(c.token_ids) for c in first.completions]:
        raise CheckFailed(f"two calls with seed {SEED} sampled different tokens")
    return f"seed {SEED}: the same tokens twice"


@SUITE.check("Score with the same temperature reproduces Generate's logprobs", "Score")
def score_matches_generate(ctx: Context) -> str:
    completions = generated(ctx).completions
    items = [policy_pb2.ScoreItem(prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.token_ids)
             for c in completions]
    scored = ctx.call("Score", policy_pb2.ScoreRequest(model=model(ctx), items=items, temperature=1.0)).results
    if len(scored) != len(items):
        raise CheckFailed(f"{len(scored)} results for {len(items)} items")
    tolerance = float(ctx.options.get("logprob_tolerance") or LOGPROB_TOLERANCE)
    worst = 0.0
    for c, result in zip(completions, scored):
        if len(result.logprobs) != len(c.token_ids):
            raise CheckFailed(f"{len(result.logprobs)} scores for {len(c.token_ids)} tokens")
        worst = max([worst, *(abs(a - b) for a, b in zip(c.logprobs, result.logprobs))])
    if worst > tolerance:
        raise CheckFailed(f"Score differs from Generate by up to {worst:.3g} nats (tolerance {tolerance:g})")
    return f"largest difference {worst:.2g} nats (tolerance {tolerance:g})"


@SUITE.check("GenerateStream yields every (prompt, sample) once", "GenerateStream")
def generate_stream_each_once(ctx: Context) -> str:
    request = generate_request(ctx)
    stream_request = policy_pb2.GenerateStreamRequest(model=request.model, prompts=request.prompts,
                                                      sampling=request.sampling)
    pairs = sorted((r.completion.prompt_index, r.completion.sample_index)
                   for r in ctx.call("GenerateStream", stream_request))
    wanted = [(i, j) for i in range(len(PROMPTS)) for j in range(2)]
    if pairs != wanted:
        raise CheckFailed(f"streamed {pairs}, {wanted} expected")
    return f"{len(pairs)} completions, each once"


@SUITE.check("Generate without max_new_tokens is INVALID_ARGUMENT", "Generate")
def generate_bad_field(ctx: Context) -> str:
    request = generate_request(ctx)
    request.sampling.max_new_tokens = 0
    return ctx.refused("Generate", request, grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_new_tokens")


@SUITE.check("Generate for an unknown model is NOT_FOUND", "Generate")
def generate_unknown_model(ctx: Context) -> str:
    request = policy_pb2.GenerateRequest(model=ctx.tag, prompts=[policy_pb2.Prompt(text=PROMPTS[0])],
                                         sampling=sampling(1))
    return ctx.refused("Generate", request, grpc.StatusCode.NOT_FOUND)


@SUITE.check("an UpdateWeights stream without commit is INVALID_ARGUMENT and keeps the version", "UpdateWeights")
def update_without_commit(ctx: Context) -> str:
    before = current_version(ctx)
    stream = [policy_pb2.UpdateWeightsRequest(model=model(ctx), version=before + 1)]  # no chunk, no commit
    why = ctx.refused("UpdateWeights", stream, grpc.StatusCode.INVALID_ARGUMENT, "commit")
    after = current_version(ctx)
    if after != before:
        raise CheckFailed(f"the version moved from {before} to {after}")
    return f"{why}; version still {before}"
