"""Compilers and their command lines, identified precisely enough to key a compile cache and
to make a verdict reproducible (the compiler's path, version line and every flag)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

# Flags a request may append (options.extra_compile_flags). Anything that names a file, a
# library, a plugin or the output is refused: those read or write outside the job.
CPU_EXTRA_FLAGS = re.compile(
    r"^-(O[0-3sz]?|Ofast|g[0-3]?|ffast-math|fno-fast-math|funroll-loops|fno-unroll-loops|fopenmp-simd|"
    r"f(no-)?(tree-vectorize|strict-aliasing|math-errno|finite-math-only|signed-zeros|trapping-math|associative-math|"
    r"reciprocal-math|omit-frame-pointer|inline-functions|prefetch-loop-arrays|peel-loops|vect-cost-model(=\w+)?)|"
    r"march=[\w.+-]+|mtune=[\w.+-]+|m(no-)?(avx|avx2|avx512\w*|fma|f16c|sse\w*|bmi2?|popcnt|prefer-vector-width=\d+)|"
    r"D[A-Za-z_]\w*(=[\w.+-]*)?|U[A-Za-z_]\w*|std=(c|gnu)\+\+(11|14|17|20|2a|23|2b)|W[\w-]*|w|pedantic)$")
CUDA_EXTRA_FLAGS = re.compile(
    r"^(-O[0-3]|--use_fast_math|-use_fast_math|-lineinfo|--extra-device-vectorization|-std=c\+\+(11|14|17|20)|"
    r"--maxrregcount=\d+|-maxrregcount=\d+|-arch=(sm|compute)_\d+a?|--gpu-architecture=(sm|compute)_\d+a?|"
    r"-Xptxas=-v|-Xptxas=-O[0-3]|--ftz=(true|false)|--prec-div=(true|false)|--prec-sqrt=(true|false)|"
    r"--fmad=(true|false)|-D[A-Za-z_]\w*(=[\w.+-]*)?|-U[A-Za-z_]\w*|-w)$")
# Always appended: a shared object, position independent, every symbol resolved at link
# time (an undefined reference is a compile error here, not a failed load later).
CPU_REQUIRED_FLAGS = ["-std=c++17", "-fPIC", "-shared", "-Wl,-z,defs"]
CUDA_REQUIRED_FLAGS = ["-std=c++17", "-Xcompiler", "-fPIC", "-shared", "-cudart", "shared", "-Xlinker", "-z,defs"]
PRELUDE = "#include <math.h>\n#include <stdint.h>\n"  # the suite's include lines, precompiled


@dataclasses.dataclass(frozen=True)
class Compiler:
    """A compiler found on this machine."""

    name: str  # as asked for: "g++", "clang++", "nvcc"
    path: str
    version: str  # its first version line
    target: str  # what "-march=native" means here (cpu), the CUDA library dir (nvcc)

    @property
    def identity(self) -> str:
        return f"{self.path}\n{self.version}\n{self.target}"


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


@functools.lru_cache(maxsize=16)
def find(name: str) -> Compiler | None:
    """The compiler called `name` (or at that path), or None when it is not installed."""
    path = shutil.which(name)
    if path is None:
        return None
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = version.stdout + version.stderr
    if Path(path).name.startswith("nvcc") or "nvcc" in text.lower() or "cuda compilation tools" in text.lower():
        release = next((line.strip() for line in text.splitlines() if "release" in line), _first_line(text))
        return Compiler(name, path, release, cuda_library_dir(path) or "")
    return Compiler(name, path, _first_line(text), native_target(path))


def native_target(path: str) -> str:
    """A digest of the target options -march=native selects on this CPU (so a cache shared
    between different machines never hands one machine another's code)."""
    try:
        result = subprocess.run([path, "-march=native", "-Q", "--help=target"], capture_output=True, text=True, timeout=60)
        text = result.stdout
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    if not text:  # clang has no -Q --help=target; its -### line lists the resolved target
        try:
            result = subprocess.run([path, "-march=native", "-###", "-x", "c++", "-c", "/dev/null", "-o", "/dev/null"],
                                    capture_output=True, text=True, timeout=60)
            text = result.stderr
        except (OSError, subprocess.TimeoutExpired):
            text = ""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=4)
def cuda_library_dir(nvcc: str) -> str | None:
    """Where nvcc's libcudart.so lives (from `nvcc -dryrun`, which prints its link paths)."""
    try:
        result = subprocess.run([nvcc, "-dryrun", "-shared", "-o", "/dev/null", "x.cu"], capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in result.stderr.splitlines():
        if "LIBRARIES=" in line:
            dirs = [d for d in re.findall(r'-L"?([^"\s]+)"?', line) if not d.rstrip("/").endswith("stubs")]
            for directory in reversed(dirs):
                if (Path(directory) / "libcudart.so").exists() or list(Path(directory).glob("libcudart.so.*")):
                    return str(Path(directory).resolve())
    return None


def cudart_path(library_dir: str) -> str | None:
    """The versioned libcudart.so.N in `library_dir` (the one nvcc links candidates against)."""
    candidates = sorted(Path(library_dir).glob("libcudart.so.*"), key=lambda p: len(p.name))
    return str(candidates[0].resolve()) if candidates else None


def cpu_command(compiler: Compiler, flags: list[str], source: str, output: str, prelude: str | None) -> list[str]:
    command = [compiler.path, *flags, *CPU_REQUIRED_FLAGS]
    if prelude:
        command += ["-include", prelude]
    return [*command, "-o", output, source]


def cuda_command(compiler: Compiler, flags: list[str], arch: str, source: str, output: str) -> list[str]:
    command = [compiler.path, *flags, f"-arch={arch}", *CUDA_REQUIRED_FLAGS]
    if compiler.target:
        command += ["-Xlinker", f"-rpath,{compiler.target}"]
    return [*command, "-o", output, source]


def bad_extra_flags(flags: list[str], cuda: bool) -> list[int]:
    """Indexes of extra flags that are not allowed."""
    pattern = CUDA_EXTRA_FLAGS if cuda else CPU_EXTRA_FLAGS
    return [i for i, flag in enumerate(flags) if not pattern.match(flag)]
