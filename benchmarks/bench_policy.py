#!/usr/bin/env python3
"""Policy service figures, as ratios measured in one run on this machine:

1. Generate through gRPC (a `leap serve policy` process on loopback) against the same hf
   backend called in-process, same prompts and seeds (target: gRPC within 5%);
2. UpdateWeights over loopback for a few hundred MB of tensors (target: 1 GB/s or more),
   against a bare grpc.aio servicer in another process that only counts the bytes of the
   same chunks (the transport's own ceiling on this machine), with the memory-copy rate;
3. Score throughput, through gRPC and in-process.

    .venv/bin/python benchmarks/bench_policy.py                 # the bootstrapped tiny model
    .venv/bin/python benchmarks/bench_policy.py --weights-mb 400 --repeats 9

Runs alternate between the two sides so that drift (other work on the machine) hits both.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from leap import prompts  # noqa: E402
from leap.clients import connect  # noqa: E402
from leap.clients.channel import channel_options  # noqa: E402
from leap.clients.weights import _in_thread, keep_freed_memory, push_weights, tensor_chunks, update_requests  # noqa: E402
from leap.policy.v1 import policy_pb2, policy_pb2_grpc  # noqa: E402
from svc_policy.engine import Job, Sample  # noqa: E402
from svc_policy.hf_backend import HFEngine  # noqa: E402
from svc_policy.text import render_prompt  # noqa: E402
from tests.conftest import BOOTSTRAP_CACHE, leap_serve, task_suite  # noqa: E402


def _build_tiny_model() -> Path:
    from leap.bootstrap import bootstrap_model

    return bootstrap_model(tasks=task_suite(), cache_dir=BOOTSTRAP_CACHE)


def tiny_model() -> Path:
    """The bootstrapped tiny model, built (when not cached) in a child process: training it
    here would leave this process's heap and threads unlike the service's and slow the
    in-process side of the comparison."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(_build_tiny_model).result()


def big_model(directory: Path, megabytes: int) -> Path:
    """A randomly initialized Qwen2 model of about `megabytes` MB of float32 weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden = 1024
    per_layer = 4 * hidden * hidden + 3 * hidden * 2816  # attention + MLP weights
    layers = max(1, int(megabytes * 1e6 / 4 - 8192 * hidden) // per_layer)
    config = Qwen2Config(vocab_size=8192, hidden_size=hidden, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                            unk_token="[UNK]").save_pretrained(directory)
    return directory


def memcpy_rate(nbytes: int) -> float:
    source = np.ones(nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def generate_requests(model_dir: Path, prompts_count: int, n: int, max_new: int):
    tasks = [t for t in task_suite() if t.split == "train"][:prompts_count]
    chat = [policy_pb2.Prompt(chat=policy_pb2.ChatPrompt(messages=prompts.first_turn(t))) for t in tasks]
    sampling = policy_pb2.SamplingParams(n=n, seed=1, temperature=1.0, max_new_tokens=max_new)
    return policy_pb2.GenerateRequest(model="policy", prompts=chat, sampling=sampling)


def in_process_generate(engine: HFEngine, request) -> tuple[float, int]:
    samples = [Sample(render_prompt(engine.tokenizer, p), i, j, 1.0, 0, 1.0, request.sampling.max_new_tokens, [],
                      frozenset(), request.sampling.seed)
               for i, p in enumerate(request.prompts) for j in range(request.sampling.n)]
    results = []
    start = time.perf_counter()
    job = Job(samples, results.append)
    engine.submit(job)
    job.done.result()
    return time.perf_counter() - start, sum(len(r.token_ids) for r in results)


def bench_generate(model_dir: Path, address: str, args) -> None:
    request = generate_requests(model_dir, args.prompts, args.n, args.max_new_tokens)
    engine = HFEngine(model_dir)
    stub = connect("policy", address, aio=False, unary_deadline=600)
    stub.Generate(request)  # warm both sides
    in_process_generate(engine, request)
    grpc_times, local_times, tokens = [], [], 0
    for repeat in range(args.repeats):
        for side in ((0, 1) if repeat % 2 == 0 else (1, 0)):
            if side == 0:
                start = time.perf_counter()
                response = stub.Generate(request)
                grpc_times.append(time.perf_counter() - start)
            else:
                seconds, tokens = in_process_generate(engine, request)
                local_times.append(seconds)
    grpc_tokens = sum(len(c.token_ids) for c in response.completions)
    assert grpc_tokens == tokens, "the two sides generated different tokens"
    engine.close()
    g, local = statistics.median(grpc_times), statistics.median(local_times)
    print(f"generate: {args.prompts} prompts x n={args.n}, {tokens} tokens; in-process {local:.3f} s "
          f"({tokens / local:.0f} tok/s), gRPC {g:.3f} s ({tokens / g:.0f} tok/s): gRPC/in-process = {g / local:.3f} "
          f"(target <= 1.05)")


def bench_score(model_dir: Path, address: str, args) -> None:
    engine = HFEngine(model_dir)
    request = generate_requests(model_dir, args.prompts, args.n, args.max_new_tokens)
    stub = connect("policy", address, aio=False, unary_deadline=600)
    completions = stub.Generate(request).completions
    items = [(list(c.prompt_token_ids), list(c.token_ids)) for c in completions]
    score = policy_pb2.ScoreRequest(model="policy", items=[
        policy_pb2.ScoreItem(prompt_token_ids=p, completion_token_ids=c) for p, c in items])
    tokens = sum(len(p) + len(c) for p, c in items)
    grpc_times, local_times = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        stub.Score(score)
        grpc_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.score(items, 1.0, 0, 1.0).result()
        local_times.append(time.perf_counter() - start)
    engine.close()
    g, local = statistics.median(grpc_times), statistics.median(local_times)
    print(f"score: {len(items)} items, {tokens} tokens; in-process {tokens / local:.0f} tok/s, gRPC {tokens / g:.0f} "
          f"tok/s: gRPC/in-process = {g / local:.3f}")


class _CountingPolicy(policy_pb2_grpc.PolicyServiceServicer):
    """The baseline: an UpdateWeights that only counts bytes (no checks, no staging)."""

    async def UpdateWeights(self, request_iterator, context):
        received = 0
        async for request in request_iterator:
            received += len(request.chunk.data)
        return policy_pb2.UpdateWeightsResponse(bytes_received=received)


def _serve_counting(ports: multiprocessing.Queue) -> None:
    keep_freed_memory()  # as the policy service does at start

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        policy_pb2_grpc.add_PolicyServiceServicer_to_server(_CountingPolicy(), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


# The first pushes grow both processes' heaps (fresh pages fault in slowly on virtual
# machines); later ones reuse them. A training run pushes every step, so the figure is the
# steady state after these, and the first push is printed apart.
WARM_PUSHES = 3


def timed_pushes(push, repeats: int) -> tuple[float, list[float]]:
    """Seconds of the first of WARM_PUSHES untimed pushes, then GB/s of `repeats` more;
    `push(version)` is a coroutine function returning bytes received."""

    async def run() -> tuple[float, list[float]]:
        rates, first = [], 0.0
        for version in range(1, WARM_PUSHES + repeats + 1):
            start = time.perf_counter()
            received = await push(version)
            seconds = time.perf_counter() - start
            if version == 1:
                first = seconds
            if version > WARM_PUSHES:
                rates.append(received / seconds / 1e9)
        return first, rates

    return asyncio.run(run())


def bare_grpc_rates(state, repeats: int) -> tuple[float, list[float]]:
    """The same chunk stream, sent the same way, to a bare servicer in another process."""
    spawn = multiprocessing.get_context("spawn")
    ports: multiprocessing.Queue = spawn.Queue()
    server = spawn.Process(target=_serve_counting, args=(ports,), daemon=True)
    server.start()
    try:
        channel = None

        async def push(version: int) -> int:
            nonlocal channel
            channel = channel or grpc.aio.insecure_channel(f"127.0.0.1:{ports.get(timeout=60)}",
                                                           options=channel_options())
            stub = policy_pb2_grpc.PolicyServiceStub(channel)
            reply = await stub.UpdateWeights(_in_thread(update_requests("policy", version, state)))
            return reply.bytes_received

        return timed_pushes(push, repeats)
    finally:
        server.kill()


def bench_weights(args) -> None:
    with tempfile.TemporaryDirectory() as work:
        directory = big_model(Path(work) / "big", args.weights_mb)
        from safetensors.torch import load_file

        state = load_file(str(directory / "model.safetensors"))
        nbytes = sum(t.nbytes for t in state.values())
        start = time.perf_counter()
        for _ in tensor_chunks(state):
            pass
        produce = nbytes / (time.perf_counter() - start) / 1e9
        with leap_serve("policy", "--models", f"policy={directory}", "--drain-seconds", "0", timeout=300) as (address, _):
            stub = None

            async def push(version: int) -> int:
                nonlocal stub
                stub = stub or connect("policy", address, stream_deadline=600)
                return (await push_weights(stub, "policy", version, state)).bytes_received

            first, rates = timed_pushes(push, args.repeats)
        bare_first, bare = bare_grpc_rates(state, args.repeats)
    ours, ceiling = statistics.median(rates), statistics.median(bare)
    print(f"weights: {nbytes / 1e6:.0f} MB over loopback at {ours:.2f} GB/s median after {WARM_PUSHES} warm-up pushes "
          f"(best {max(rates):.2f}; the first push took {first:.2f} s; target >= 1 GB/s); a bare gRPC servicer "
          f"counting the same chunks {ceiling:.2f} GB/s (first {bare_first:.2f} s; ours/bare = {ours / ceiling:.2f}); "
          f"memcpy {memcpy_rate(nbytes):.1f} GB/s; client chunking alone {produce:.2f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--weights-mb", type=int, default=300)
    parser.add_argument("--only", choices=["generate", "score", "weights"], action="append")
    args = parser.parse_args()
    only = set(args.only or ["generate", "score", "weights"])
    # The service does this at start (PolicyConfig.keep_freed_memory); the in-process side
    # gets the same allocator behaviour, or it pays page faults the service does not.
    keep_freed_memory()
    print(f"torch threads {torch.get_num_threads()}; the machine may be shared: figures are ratios in one run")
    if only & {"generate", "score"}:
        model_dir = tiny_model()
        with leap_serve("policy", "--models", f"policy={model_dir}", "--drain-seconds", "0") as (address, _):
            if "generate" in only:
                bench_generate(model_dir, address, args)
            if "score" in only:
                bench_score(model_dir, address, args)
    if "weights" in only:
        bench_weights(args)


if __name__ == "__main__":
    main()
