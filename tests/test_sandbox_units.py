"""Pure parts of the sandbox, without a server: the static check, output comparison,
timing statistics and order, log trimming, throttle detection, allowed compile flags, the
wire format's defence against malformed frames, and the compile cache under concurrency."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import socket
import struct

import numpy as np
import pytest

from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2
from svc_sandbox import checking, compilers, static_check, timing
from svc_sandbox.compile_cache import CompileCache, cache_key
from svc_sandbox.wire import WireError, WireTimeout, recv_frame, send_frame

CPU = common_pb2.Toolchain.TOOLCHAIN_CPU
KB = common_pb2.Toolchain.TOOLCHAIN_KERNELBENCH
KERNEL = '#include <math.h>\n#include <stdint.h>\nextern "C" void relu(const float* x, float* y, int64_t n) {{\n{}\n}}\n'


def rules(code: str, toolchain: int = CPU, forbidden=()) -> set[str]:
    return {f.rule for f in static_check.static_check(code, toolchain, list(forbidden))}


@pytest.mark.parametrize("body, rule", [
    ("if (fork() == 0) {}", "spawns processes"),
    ('system("ls");', "spawns processes"),
    ("execve(0, 0, 0);", "spawns processes"),
    ("std::thread t([]{}); t.join();", "spawns threads"),
    ("pthread_create(0, 0, 0, 0);", "spawns threads"),
    ('FILE* f = fopen("/etc/shadow", "r");', "opens files or sockets"),
    ("std::ifstream in(argv);", "opens files or sockets"),
    ("int s = socket(2, 1, 0);", "opens files or sockets"),
    ('void* h = dlopen("libcblas.so", 2);', "loads code at run time"),
    ("struct timespec t; clock_gettime(0, &t);", "patches or reads timers"),
    ("auto t = std::chrono::steady_clock::now();", "patches or reads timers"),
    ('asm volatile("syscall");', "issues system calls"),
])
def test_static_check_rejects_what_a_kernel_must_not_do(body, rule):
    assert rule in rules(KERNEL.format(body))


@pytest.mark.parametrize("line, rule", [
    ("#include <thread>", "spawns threads"),
    ('#include "/etc/passwd"', "opens files or sockets"),
    ("#include <sys/socket.h>", "opens files or sockets"),
    ("#include <chrono>", "patches or reads timers"),
    ("__attribute__((constructor)) static void early() {}", "runs code at load time"),
])
def test_static_check_rejects_includes_and_load_time_code(line, rule):
    assert rule in rules(line + "\n" + KERNEL.format(""))


def test_static_check_ignores_comments_strings_and_ordinary_kernels():
    code = KERNEL.format('    // fork() or system() in a comment\n    /* fopen("x") */ const char* s = "socket(";\n'
                         "    #pragma omp parallel for\n    for (int64_t i = 0; i < n; i++) y[i] = expf(x[i]);")
    assert rules(code) == set()
    cuda = ("__global__ void k(float* y) { asm(\"mov.u32 %0, %%laneid;\" : \"=r\"(i)); }\n"
            'extern "C" void relu(const float* x, float* y, int64_t n) { cudaMemset(y, 0, 4); k<<<1, 1>>>(y); }')
    assert rules(cuda) == set()


def test_static_check_rejects_the_reference_library_where_the_task_forbids_it():
    code = KERNEL.format("cblas_sgemm(101, 111, 111, 1, 1, 1, 1.0f, x, 1, x, 1, 0.0f, y, 1);")
    assert rules(code, forbidden=["cblas_sgemm"]) == {"calls the reference library, which this task forbids"}
    assert rules(code) == set()  # allowed where the task does not forbid it (it would not link anyway)


@pytest.mark.parametrize("code, rule", [
    ("import subprocess\n", "spawns processes"),
    ("import os\nos.system('ls')\n", "spawns processes"),
    ("from threading import Thread\n", "spawns threads"),
    ("data = open('/etc/passwd').read()\n", "opens files or sockets"),
    ("import time\n", "patches or reads timers"),
    ("import torch\ntorch.cuda.synchronize = lambda: None\n", "patches a library"),
    ("import torch.nn.functional as F\nF.gelu = lambda x: x\n", "patches a library"),
    ("import torch\nsetattr(torch, 'matmul', None)\n", "patches the interpreter"),
    ("import sys\nsys.modules['x'] = None\n", "patches the interpreter"),
    ("eval('1')\n", "loads code at run time"),
    ("src = '#include <unistd.h>\\nint f() { return fork(); }'\n", "spawns processes"),
])
def test_static_check_of_kernelbench_modules(code, rule):
    assert rule in rules("import torch\nclass ModelNew(torch.nn.Module):\n    pass\n" + code, KB)


def test_kernelbench_module_may_use_torch_and_load_inline():
    code = ("import os\nimport torch\nfrom torch.utils.cpp_extension import load_inline\n"
            "os.environ['TORCH_CUDA_ARCH_LIST'] = '9.0'\n"
            "src = '#include <torch/extension.h>\\ntorch::Tensor f(torch::Tensor x) { return x * 2; }'\n"
            "class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        self.y = torch.relu(x)\n"
            "        return torch.matmul(x, x)\n")
    assert rules(code, KB) == set()
    assert rules(code, KB, forbidden=["torch.matmul"]) == {"calls the reference op, which this task forbids"}


def test_entry_point_and_model_new_are_required():
    assert static_check.missing_entry_point(KERNEL.format(""), CPU, "relu") is None
    assert "no function gelu" in static_check.missing_entry_point(KERNEL.format(""), CPU, "gelu")
    assert static_check.missing_entry_point("// relu(\nint x;", CPU, "relu")  # a comment is not a definition
    assert static_check.missing_entry_point("class Model: pass", KB, "ModelNew") == "no class ModelNew is defined"
    assert static_check.missing_entry_point("class ModelNew(:", KB, "ModelNew") is None  # COMPILE reports it


def test_compare_reports_the_first_bad_element_and_why():
    expected = np.arange(8, dtype=np.float64)
    assert checking.compare("y", 0, expected.astype(np.float32), expected, 1e-6, 1e-6) is None
    got = expected.astype(np.float32).copy()
    got[5] = -1.0
    m = checking.compare("y", 2, got, expected, 1e-6, 1e-6)
    assert (m.output, m.trial, m.first_bad_index, m.expected, m.got, m.bad_elements, m.total_elements, m.reason) == \
        ("y", 2, 5, 5.0, -1.0, 1, 8, "values")
    assert m.max_abs_error == 6.0
    got[5] = np.nan
    assert checking.compare("y", 0, got, expected, 1e-6, 1e-6).reason == "nan"
    untouched = got.copy()
    untouched.view(np.uint8)[12:16] = checking.SENTINEL_BYTE  # element 3 never written
    m = checking.compare("y", 0, untouched, expected, 1e-6, 1e-6)
    assert m.reason == "output not written" and m.first_bad_index == 3
    assert checking.compare("y", 0, untouched, expected, 1e-6, 1e-6, sentinel=False).reason == "nan"
    assert checking.compare("y", 0, got[:4], expected, 1, 1).reason == "shape"


def test_tolerance_is_absolute_plus_relative():
    expected = np.array([100.0, 0.0])
    assert checking.compare("y", 0, np.array([100.5, 0.0005]), expected, 1e-3, 1e-2) is None
    assert checking.compare("y", 0, np.array([101.5, 0.0]), expected, 1e-3, 1e-2).first_bad_index == 0


def test_timing_stats_and_alternating_order():
    stats = checking.timing_stats([0.001, 0.003, 0.002])
    assert (stats.median_ms, stats.min_ms, stats.max_ms, stats.trials) == (2.0, 1.0, 3.0, 3)
    assert stats.mean_ms == pytest.approx(2.0) and stats.std_ms == pytest.approx(0.8165, rel=1e-3)
    assert [timing.order(i, alternate=True) for i in range(3)] == [("reference", "candidate"),
                                                                  ("candidate", "reference"),
                                                                  ("reference", "candidate")]
    assert {timing.order(i, alternate=False) for i in range(3)} == {("reference", "candidate")}


def test_the_signed_rank_interval_has_the_published_critical_values():
    # Two-sided 5%: the signed-rank test rejects at T <= 0, 2, 3, 5, 8 for 6-10 observations
    # (tables of the Wilcoxon test), so the interval drops k - 1 = that + 1 Walsh averages a side.
    assert [timing.signed_rank_k(n) for n in range(6, 11)] == [1, 3, 4, 6, 9]
    assert [timing.signed_rank_k(n) for n in range(1, 6)] == [1] * 5  # none reaches 95%: [min, max]
    # Past 60 blocks a normal approximation, which at 60 agrees with the exact distribution.
    def normal(n: int) -> float:
        return n * (n + 1) / 4 - 1.959964 * math.sqrt(n * (n + 1) * (2 * n + 1) / 24) + 0.5

    assert timing.signed_rank_k(60) == math.floor(normal(60)) == 649
    assert timing.signed_rank_k(200) == math.floor(normal(200))


def test_the_speedup_and_its_interval_are_hodges_lehmann_on_log_ratios():
    center, low, high = timing.hodges_lehmann_interval([3.0, 1.0, 2.0])  # 3 blocks: [min, max]
    walsh = sorted([math.log(3), math.log(2), 0.0, math.log(6) / 2, math.log(3) / 2, math.log(2) / 2])
    assert (low, high) == pytest.approx((1.0, 3.0)) and center == pytest.approx(math.exp((walsh[2] + walsh[3]) / 2))
    assert timing.hodges_lehmann_interval([2.0]) == pytest.approx((2.0, 2.0, 2.0))
    assert timing.hodges_lehmann_interval([]) == (0.0, 0.0, 0.0)
    assert timing.hodges_lehmann_interval([0.0, 2.0])[0] == pytest.approx(2.0)  # a non-positive ratio is left out
    # A ratio and its inverse are symmetric: the speedup of the inverse is the inverse.
    ratios = [1.31, 1.52, 1.44, 1.38, 1.61, 1.47, 1.29, 1.5]
    center, low, high = timing.hodges_lehmann_interval(ratios)
    assert timing.hodges_lehmann_interval([1 / r for r in ratios]) == pytest.approx((1 / center, 1 / high, 1 / low))
    # One block spoiled by a pre-emption (a 40x ratio) moves it by little.
    assert timing.hodges_lehmann_interval(ratios[:-1] + [40.0])[0] == pytest.approx(center, rel=0.05)
    assert timing.relative_width(0.9, 1.1, 1.0) == pytest.approx(0.2) and timing.relative_width(1, 2, 0) == math.inf


def test_the_interval_covers_the_centre_at_its_confidence_and_is_narrower_than_the_medians():
    # Log ratios symmetric about log 1.5 (a heavy-tailed t with 3 degrees of freedom), 10
    # blocks: the interval covers 1.5 in at least ~95% of 4000 sessions, and is narrower on
    # average than the median's distribution-free interval of the same blocks ([2nd, 9th]).
    rng = np.random.default_rng(7)
    covered, hl_width, median_width = 0, 0.0, 0.0
    for _ in range(4000):
        ratios = np.exp(math.log(1.5) + 0.05 * rng.standard_t(3, size=10))
        center, low, high = timing.hodges_lehmann_interval(list(ratios))
        covered += low <= 1.5 <= high
        ordered = np.sort(ratios)
        hl_width += timing.relative_width(low, high, center)
        median_width += timing.relative_width(ordered[1], ordered[8], float(np.median(ratios)))
    assert covered / 4000 >= 0.94, covered / 4000
    assert hl_width < 0.9 * median_width, (hl_width / 4000, median_width / 4000)


def test_blocks_of_both_orders_cancel_an_order_effect():
    # The side that runs second is 30% slower (the candidate) and 6% (the reference): per-pair
    # ratios fall in two clusters (2.64 and 1.89); every block of one pair of each order has
    # the same ratio, so the interval is a point.
    reference = [31.5, 33.5] * 5
    candidate = [16.5, 12.5] * 5
    per_pair = timing.block_ratios(reference, candidate, 1)
    assert min(per_pair) == pytest.approx(31.5 / 16.5) and max(per_pair) == pytest.approx(33.5 / 12.5)
    blocks = timing.block_ratios(reference, candidate, timing.block_size(alternate=True))
    assert blocks == pytest.approx([65.0 / 29.0] * 5)
    center, low, high = timing.speedup_interval(reference, candidate, alternate=True)  # what a verdict reports
    assert (center, low, high) == pytest.approx((65.0 / 29.0,) * 3)
    center, low, high = timing.speedup_interval(reference, candidate, alternate=False)  # pairs alone: two clusters
    assert timing.relative_width(low, high, center) > 0.3
    assert timing.block_ratios(reference[:3], candidate[:3], 2) == pytest.approx([65.0 / 29.0])  # incomplete: left out
    assert timing.block_ratios([2.0], [1.0], 2) == [2.0]  # fewer pairs than a block: each pair its own
    assert timing.block_ratios([2.0, 3.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], 2) == [5.0]  # a zero total is left out
    assert timing.block_size(alternate=False) == 1


def test_timed_runs_stop_at_a_narrow_interval_or_a_budget():
    stop = functools.partial(timing.should_stop, min_pairs=5, max_pairs=20, target_width=0.1, budget_seconds=2.0)
    assert not stop(4, 0.01, elapsed=0.1)  # fewer than asked for
    assert stop(5, 0.05, elapsed=0.1) and not stop(5, 0.3, elapsed=0.1)
    assert stop(20, 0.3, elapsed=0.1) and stop(7, 0.3, elapsed=2.5)
    assert not stop(2, 0.3, elapsed=2.5)  # the request's minimum always runs
    assert not stop(5, 0.05, elapsed=0.1, block=2) and stop(6, 0.05, elapsed=0.1, block=2)  # whole blocks
    assert stop(21, 0.3, elapsed=0.1, max_pairs=21, block=2)  # the budget in runs ends it mid-block
    assert timing.calls_per_run(1e-5, 1e-3, 256) == 100 and timing.calls_per_run(1e-2, 1e-3, 256) == 1
    assert timing.calls_per_run(1e-7, 1e-3, 256) == 256 and timing.calls_per_run(0.0, 1e-3, 8) == 8
    # A known pace: a power of two, within the slots, and the candidate's run inside its bound.
    paced = timing.paced_calls
    assert paced(30e-6, 1e-3, 256, 0.0, math.inf) == 32 and paced(25e-6, 1e-3, 256, 1e-6, 0.1) == 32
    assert paced(30e-6, 1e-3, 20, 0.0, math.inf) == 16 and paced(1e-2, 1e-3, 256, 0.0, math.inf) == 1
    assert paced(30e-6, 1e-3, 256, 0.03, 0.1) == 3 and paced(30e-6, 1e-3, 256, 1.0, 0.1) == 1


def test_compare_streams_in_chunks_and_releases_them():
    expected = np.arange(10_000, dtype=np.float64)
    got = expected.astype(np.float32)
    released = []
    assert checking.compare("y", 0, got, expected, 0, 0, chunk=4096,
                            release=lambda start, end: released.append((start, end))) is None
    assert released == [(0, 4096), (4096, 8192), (8192, 10_000)]
    got[9000] = -1.0
    got[100] = np.nan
    m = checking.compare("y", 0, got, expected, 0, 0, chunk=4096)
    assert (m.first_bad_index, m.bad_elements, m.reason) == (100, 2, "nan")
    assert m.max_abs_error == 9001.0  # over every chunk, not just the first bad one


def test_log_trimming_keeps_the_head_within_the_limit():
    log = "kernel.cpp:3: error: first\n" + "noise\n" * 1000
    trimmed, cut = checking.trim_log(log, 200)
    assert cut and trimmed.startswith("kernel.cpp:3: error: first") and len(trimmed.encode()) <= 200
    assert checking.trim_log("short", 200) == ("short", False)


def test_throttle_reasons_that_make_timing_unreliable():
    idle = sandbox_pb2.TelemetrySample(throttle_reasons=["gpu_idle"])
    hot = sandbox_pb2.TelemetrySample(throttle_reasons=["sw_thermal_slowdown", "gpu_idle"])
    assert checking.throttled([idle]) == []
    assert checking.throttled([idle, hot]) == ["sw_thermal_slowdown"]


def test_extra_compile_flags_allow_tuning_but_nothing_that_touches_files():
    good = ["-O2", "-ffast-math", "-march=skylake", "-mavx2", "-DTILE=64", "-funroll-loops", "-Wall"]
    assert compilers.bad_extra_flags(good, cuda=False) == []
    bad = ["-o/tmp/x", "-include/etc/passwd", "-I/", "-lcblas", "-Wl,--wrap=clock_gettime", "@/etc/flags",
           "-fplugin=x.so", "-B/tmp", "-specs=x"]
    assert compilers.bad_extra_flags(bad, cuda=False) == list(range(len(bad)))
    assert compilers.bad_extra_flags(["--use_fast_math", "-lineinfo", "-arch=sm_90a", "--maxrregcount=64"], cuda=True) == []
    assert compilers.bad_extra_flags(["-Xcompiler=-fplugin=x.so", "-ccbin=/tmp/cc"], cuda=True) == [0, 1]


def test_wire_frames_round_trip_and_reject_malformed_input():
    left, right = socket.socketpair()
    with left, right:
        send_frame(left, {"event": "trial", "n": 1}, b"\x00\x01")
        assert recv_frame(right, deadline=None) == ({"event": "trial", "n": 1}, bytearray(b"\x00\x01"))
        left.sendall(struct.pack("!IQ", 1 << 30, 0))
        with pytest.raises(WireError, match="too large"):
            recv_frame(right)
        left.sendall(struct.pack("!IQ", 2, 0) + b"[]")
        with pytest.raises(WireError, match="not an object"):
            recv_frame(right)
        with pytest.raises(WireTimeout):
            import time
            recv_frame(right, deadline=time.monotonic() + 0.05)


def test_compile_cache_is_consistent_under_concurrent_writers(tmp_path):
    cache = CompileCache(tmp_path / "cache", max_bytes=1 << 30)
    obj = tmp_path / "k.so"
    obj.write_bytes(b"\x7fELF" + b"x" * 100_000)
    key = cache_key("cpu", "g++ 12", "-O3", "code")
    assert key != cache_key("cpu", "g++ 12", "-O2", "code") and cache.lookup(key) is None

    def store(i: int) -> None:
        cache.store(key, True, f"log {i}", 0.1, obj)
        entry = cache.lookup(key)
        assert entry is not None and entry.ok and entry.object_path.read_bytes() == obj.read_bytes()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(store, range(32)))
    assert not [p for p in (tmp_path / "cache").rglob(".tmp-*")]  # no torn temporaries left
    placed = tmp_path / "placed.so"
    cache.place(cache.lookup(key), placed)
    assert placed.read_bytes() == obj.read_bytes()
    failure = cache_key("cpu", "broken")
    cache.store(failure, False, "kernel.cpp:1: error: x", 0.05)
    assert cache.lookup(failure) == type(cache.lookup(failure))(False, "kernel.cpp:1: error: x", None, 0.05)
    assert json.loads(next((tmp_path / "cache").rglob(f"{failure}.json")).read_text())["ok"] is False


def test_compile_cache_evicts_least_recently_used_over_budget(tmp_path):
    cache = CompileCache(tmp_path / "cache", max_bytes=250_000)
    obj = tmp_path / "k.so"
    obj.write_bytes(b"x" * 100_000)
    keys = [cache_key(str(i)) for i in range(4)]
    import os
    import time
    for i, key in enumerate(keys):
        cache.store(key, True, "", 0.0, obj)
        meta = next((tmp_path / "cache").rglob(f"{key}.json"))
        os.utime(meta, (time.time() - 100 + i, time.time() - 100 + i))
    assert cache.evict() == 2
    assert [cache.lookup(k) is not None for k in keys] == [False, False, True, True]


def test_a_run_written_in_one_operation_holds_what_a_call_by_call_write_gives():
    """Region.rows / scramble_rows / fill write every call of a timed run at once (the
    service's cost per call was mostly Python); each slot must get exactly the bytes that
    scramble_into and a per-slot fill give, and nothing outside the tensors may change."""
    from svc_sandbox import shm
    from svc_sandbox.references import mantissa_key, scramble_into, scramble_rows

    rng = np.random.default_rng(3)
    layout = shm.Layout((shm.Tensor("x", "<f4", (3, 37)), shm.Tensor("i", "<i8", (5,)),
                         shm.Tensor("h", "bfloat16", (6000,)), shm.Tensor("d", "<f8", (9,)),
                         shm.Tensor("big", "<f4", (17000,)),  # over ROW_BY_ROW_BYTES: row by row
                         shm.Tensor("pooled", "<f4", (40,)), shm.Tensor("pooled_big", "<f4", (17000,))),
                        (shm.Tensor("out", "<f4", (1100,)),), slots=7)
    batched, looped = shm.Region(layout, "a"), shm.Region(layout, "b")
    try:
        for region in (batched, looped):
            np.frombuffer(region.map, dtype=np.uint8)[:] = 0x5A  # the gaps between tensors too
        calls = 6
        sources = {"x": [rng.random((3, 37), dtype=np.float32) for _ in range(calls)],
                   "i": [rng.integers(-9, 9, 5) for _ in range(calls)],
                   "h": [rng.integers(0, 1 << 16, 6000).astype(np.uint16) for _ in range(calls)],
                   "d": [rng.random(9) for _ in range(calls)],
                   "big": [rng.random(17000, dtype=np.float32) for _ in range(calls)]}
        # pool sets: one array object for consecutive slots (one broadcast operation each),
        # and one set used again after another (its runs are not merged)
        small, large = ([rng.random(n, dtype=np.float32) for _ in range(2)] for n in (40, 17000))
        sources["pooled"] = [small[0], small[0], small[0], small[1], small[1], small[0]]
        sources["pooled_big"] = [large[1], large[0], large[0], large[0], large[0], large[1]]
        keys = {name: [mantissa_key(np.asarray(s[0]).dtype, rng) if np.asarray(s[0]).dtype.kind == "f" else 0
                       for _ in range(calls)] for name, s in sources.items()}
        for index, name in enumerate(sources):
            scramble_rows(sources[name], batched.rows(index, calls), keys[name])
            for slot in range(calls):
                scramble_into(sources[name][slot], looped.view(slot, index), keys[name][slot])
        out = len(layout.inputs)
        batched.fill(range(calls), [out], 0xFF)
        batched.fill([6], [out], 0xFF, chunk=64)  # not consecutive with a chunk smaller than the tensor: call by call
        for slot in list(range(calls)) + [6]:
            looped.raw(slot, out)[:] = 0xFF
        assert np.frombuffer(batched.map, dtype=np.uint8).tobytes() == np.frombuffer(looped.map, dtype=np.uint8).tobytes()
        x0 = batched.view(0, 0).view(np.uint32) ^ np.uint32(keys["x"][0])
        assert np.array_equal(x0, sources["x"][0].reshape(-1).view(np.uint32))  # and it is the scramble, not a copy
        assert not np.array_equal(batched.view(0, 0), sources["x"][0].reshape(-1))
        d1 = batched.view(1, 3).view(np.uint64) ^ np.uint64(keys["d"][1])  # the 8-byte path too
        assert np.array_equal(d1, sources["d"][1].view(np.uint64))
        assert np.array_equal(batched.view(2, 1), sources["i"][2])  # integers copied
        for slot in (2, 3, 5):  # each slot of a shared pool set has its own key
            p = batched.view(slot, 5).view(np.uint32) ^ np.uint32(keys["pooled"][slot])
            assert np.array_equal(p, sources["pooled"][slot].view(np.uint32))
    finally:
        batched.close()
        looped.close()
