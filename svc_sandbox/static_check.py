"""The FORMAT stage: is there an entry point, and does the code stay within what a kernel
may do? Pure functions over source text.

The static check is a filter for honest mistakes and cheap tricks, not the boundary: what
holds against a determined candidate is the confinement (confinement.py: its own uid,
namespaces, a read-only view, a syscall filter), which does not care how a call was
spelled. It rejects code that calls the reference library for the whole op where the task
forbids it, patches or reads timers, spawns threads or processes, opens files or sockets,
loads code at run time, runs code at load time (constructors), issues system calls from
inline assembly (string pieces joined, raw opcodes too), and what would hide any of that
from it: names pasted together in the preprocessor (`##`), computed includes
(`#include MACRO`), and in Python reflection (`getattr(os, ...)`, `vars`, `__dict__`,
`__builtins__`, frames) and star imports. Comments are ignored, so a rule never fires on
prose; string literals in C are ignored too (but the C++ sources a KernelBench module
passes to `load_inline` are checked as C).
"""

from __future__ import annotations

import ast
import dataclasses
import re

from leap.common.v1 import common_pb2

Toolchain = common_pb2.Toolchain


@dataclasses.dataclass(frozen=True)
class Finding:
    """One reason the code is rejected."""

    rule: str  # what kind of thing it does, for example "spawns processes"
    name: str  # the offending name, for example "fork"
    line: int  # 1-based line in the extracted code

    def describe(self) -> str:
        return f"line {self.line}: {self.name} ({self.rule})"


def _calls(*names: str) -> list[str]:
    return [rf"\b{re.escape(n)}\s*\(" for n in names]


# rule -> patterns over C/C++/CUDA code with comments and string literals removed
C_RULES: dict[str, list[str]] = {
    "spawns processes": _calls("fork", "vfork", "clone", "clone3", "execv", "execve", "execvp", "execvpe", "execl",
                               "execlp", "execle", "fexecve", "system", "popen", "posix_spawn", "posix_spawnp", "daemon",
                               "kill", "ptrace", "setsid", "setpgid", "prctl", "unshare"),
    "spawns threads": [r"\bstd\s*::\s*(thread|jthread|async)\b", *_calls("pthread_create", "thrd_create"),
                       r"#\s*include\s*<\s*(thread|future|pthread\.h|threads\.h)\s*>"],
    "opens files or sockets": [*_calls("fopen", "fopen64", "freopen", "open", "open64", "openat", "creat", "fdopen",
                                       "opendir", "socket", "socketpair", "connect", "bind", "listen", "accept",
                                       "getaddrinfo", "gethostbyname", "shm_open", "mmap", "mmap64", "unlink", "rename",
                                       "truncate", "mkfifo", "inotify_init"),
                               r"\bstd\s*::\s*[io]?fstream\b", r"\b[io]?fstream\b", r"\bFILE\s*\*",
                               r"#\s*include\s*<\s*(fstream|sys/socket\.h|netinet/[\w.]+|arpa/[\w.]+|netdb\.h|sys/mman\.h|"
                               r"dirent\.h|fcntl\.h|filesystem)\s*>",
                               r"#\s*(include|embed)\s*[<\"]\s*(/|[^>\"]*\.\.)"],
    "loads code at run time": _calls("dlopen", "dlsym", "dlmopen", "syscall", "mprotect"),
    "patches or reads timers": [*_calls("clock_gettime", "gettimeofday", "clock", "time", "times", "getrusage", "__rdtsc",
                                        "__rdtscp", "rdtsc", "timespec_get", "settimeofday", "clock_settime"),
                                r"\bstd\s*::\s*chrono\b", r"#\s*include\s*<\s*(chrono|ctime|time\.h|sys/time\.h)\s*>"],
    "runs code at load time": [r"__attribute__\s*\(\s*\(\s*(constructor|destructor)", r"\.init_array", r"\.fini_array"],
    "changes signal handling": _calls("signal", "sigaction", "setjmp", "longjmp", "sigsetjmp", "siglongjmp"),
    # The preprocessor can assemble any name this check looks for (CAT(sys, tem)) or pull in
    # any file (#include MACRO): what it would hide is refused instead.
    "builds names in the preprocessor": [r"#\s*define\b(?:[^\n]|\\\n)*?##"],
    "includes a computed file name": [r"#\s*(include|include_next|embed|import)\s*[^\s<\"]"],
}
_ASM_STATEMENT = re.compile(r"\b(__asm__|__asm|asm)\b\s*(volatile|__volatile__|goto|inline|\s)*\(", re.DOTALL)
_ASM_SYSCALL = re.compile(r"syscall|sysenter|int\s*\$?(0x80|128)\b|0x0f\s*,\s*0x0?5\b|0x0f\s*,\s*0x34\b|"
                          r"0xcd\s*,\s*0x80\b|\\x0f\\x05|\\x0f\\x34|\\xcd\\x80", re.IGNORECASE)

# Python (kernelbench) rules, over the AST
PY_FORBIDDEN_MODULES = {
    "subprocess": "spawns processes", "multiprocessing": "spawns processes", "pty": "spawns processes",
    "threading": "spawns threads", "_thread": "spawns threads", "concurrent": "spawns threads", "asyncio": "spawns threads",
    "socket": "opens files or sockets", "ssl": "opens files or sockets", "http": "opens files or sockets",
    "urllib": "opens files or sockets", "requests": "opens files or sockets", "shutil": "opens files or sockets",
    "pathlib": "opens files or sockets", "tempfile": "opens files or sockets", "io": "opens files or sockets",
    "pickle": "opens files or sockets", "ctypes": "loads code at run time", "cffi": "loads code at run time",
    "importlib": "loads code at run time", "builtins": "patches the interpreter", "gc": "patches the interpreter",
    "inspect": "patches the interpreter", "signal": "changes signal handling", "time": "patches or reads timers",
    "timeit": "patches or reads timers", "resource": "changes limits",
}
PY_REFLECTION = "reaches names by reflection, which hides calls from this check"
PY_DUNDER_ATTRIBUTES = {"__dict__", "__globals__", "__builtins__", "__subclasses__", "__getattribute__", "__code__",
                        "__closure__", "__import__", "__loader__", "__spec__", "__bases__", "__mro__", "__base__",
                        "__self__", "__func__", "__reduce__", "__reduce_ex__", "__getattr__", "f_globals", "f_locals",
                        "f_back", "gi_frame", "tb_frame"}
PY_FORBIDDEN_CALLS = {
    "open": "opens files or sockets", "exec": "loads code at run time", "eval": "loads code at run time",
    "vars": PY_REFLECTION, "locals": PY_REFLECTION,
    "compile": "loads code at run time", "__import__": "loads code at run time", "setattr": "patches the interpreter",
    "delattr": "patches the interpreter", "globals": "patches the interpreter", "breakpoint": "patches the interpreter",
}
PY_FORBIDDEN_ATTRIBUTES = {  # dotted prefixes of calls or accesses
    "os.system": "spawns processes", "os.popen": "spawns processes", "os.fork": "spawns processes",
    "os.exec": "spawns processes", "os.spawn": "spawns processes", "os.posix_spawn": "spawns processes",
    "os.kill": "spawns processes", "os.killpg": "spawns processes", "os.open": "opens files or sockets",
    "os.remove": "opens files or sockets", "os.unlink": "opens files or sockets", "os.rename": "opens files or sockets",
    "os.replace": "opens files or sockets", "os.listdir": "opens files or sockets", "os.scandir": "opens files or sockets",
    "os.walk": "opens files or sockets", "os.chdir": "opens files or sockets", "os.setsid": "spawns processes",
    "sys.modules": "patches the interpreter", "sys.settrace": "patches the interpreter",
    "sys.setprofile": "patches the interpreter", "sys._getframe": "patches the interpreter",
    "torch.multiprocessing": "spawns processes", "torch.utils.cpp_extension.load": "loads code at run time",
}
# (Assigning to an attribute of an imported module, such as torch.cuda.synchronize or
# time.perf_counter, is "patches a library" whatever the attribute.)


def strip_c_comments_and_strings(code: str) -> str:
    """The code with comments and string/char literals blanked out, line structure kept."""
    out = []
    i, n = 0, len(code)
    while i < n:
        two = code[i:i + 2]
        if two == "//":
            end = code.find("\n", i)
            end = n if end < 0 else end
            i = end
        elif two == "/*":
            end = code.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append("".join(ch if ch == "\n" else " " for ch in code[i:end]))
            i = end
        elif code[i] in "\"'":
            quote, j = code[i], i + 1
            while j < n and code[j] != quote and code[j] != "\n":
                j += 2 if code[j] == "\\" else 1
            out.append(quote + " " * max(0, min(j, n) - i - 1) + quote)
            i = j + 1
        else:
            out.append(code[i])
            i += 1
    return "".join(out)


def _line_of(text: str, position: int) -> int:
    return text.count("\n", 0, position) + 1


def _forbidden_name_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![\w.]){re.escape(name)}(?!\w)")


def check_c(code: str, forbidden_calls: list[str] | tuple[str, ...] = ()) -> list[Finding]:
    """Findings in C, C++ or CUDA code (empty: the code passes)."""
    clean = strip_c_comments_and_strings(code)
    # An include line's path is a string literal for the stripper; check includes on the raw text.
    includes = "\n".join(_directive_lines(code))
    findings = []
    for rule, patterns in C_RULES.items():
        for pattern in patterns:
            text = includes if pattern.startswith("#") else clean
            for match in re.finditer(pattern, text):
                findings.append(Finding(rule, match.group(0).rstrip("( \t").strip(), _line_of(text, match.start())))
    for start, text in _asm_statements(code):
        match = _ASM_SYSCALL.search(text)
        if match:
            findings.append(Finding("issues system calls", "asm " + match.group(0), _line_of(code, start)))
    for name in forbidden_calls:
        for match in _forbidden_name_pattern(name).finditer(clean):
            findings.append(Finding("calls the reference library, which this task forbids", name,
                                    _line_of(clean, match.start())))
    return _dedupe(findings)


def _directive_lines(code: str) -> list[str]:
    """Each line that is part of a preprocessor directive (continuation lines included),
    others blank, so line numbers stay those of the code."""
    lines, inside = [], False
    for line in code.splitlines():
        inside = inside or line.lstrip().startswith("#")
        lines.append(line if inside else "")
        inside = inside and line.rstrip().endswith("\\")
    return lines


def _asm_statements(code: str) -> list[tuple[int, str]]:
    """Each inline-assembly statement's position and its text, adjacent string literals
    joined ("sys" "call" is "syscall" to the assembler)."""
    found = []
    for match in _ASM_STATEMENT.finditer(code):
        depth, i = 1, match.end()
        while i < len(code) and depth:
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            i += 1
        body = code[match.end():i - 1]
        joined = re.sub(r'"\s*"', "", body)  # "sys" "call" -> "syscall"
        found.append((match.start(), joined))
    return found


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def check_python(code: str, forbidden_calls: list[str] | tuple[str, ...] = ()) -> list[Finding]:
    """Findings in a KernelBench module. A module that does not parse yields none: the
    COMPILE stage reports its syntax error."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    findings: list[Finding] = []
    aliases: dict[str, str] = {}  # local name -> module path, from the imports
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[(alias.asname or alias.name).split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
                _check_module(alias.name, node.lineno, findings)
        elif isinstance(node, ast.ImportFrom) and node.module:
            _check_module(node.module, node.lineno, findings)
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                _check_attribute(f"{node.module}.{alias.name}", node.lineno, findings)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
            findings.append(Finding("imports every name of a module, which hides calls from this check",
                                    f"from {node.module} import *", node.lineno))
        if isinstance(node, ast.Attribute) and node.attr in PY_DUNDER_ATTRIBUTES:
            findings.append(Finding(PY_REFLECTION, node.attr, node.lineno))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            target = _dotted(node.args[0]) if node.args else None
            named = len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
            if target and target.split(".")[0] in aliases:  # getattr(os, "sys" + "tem")
                findings.append(Finding(PY_REFLECTION, f"getattr({target}, ...)", node.lineno))
            elif named and node.args[1].value.startswith("__") and node.args[1].value in PY_DUNDER_ATTRIBUTES:
                findings.append(Finding(PY_REFLECTION, f"getattr(..., {node.args[1].value!r})", node.lineno))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PY_FORBIDDEN_CALLS:
            findings.append(Finding(PY_FORBIDDEN_CALLS[node.func.id], node.func.id, node.lineno))
        if isinstance(node, (ast.Attribute, ast.Name)) and not isinstance(getattr(node, "ctx", None), ast.Store):
            dotted = _dotted(node)
            if dotted:
                _check_attribute(_resolve(dotted, aliases), node.lineno, findings)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                dotted = _dotted(target) if isinstance(target, ast.Attribute) else None
                if dotted and dotted.split(".")[0] in aliases:
                    findings.append(Finding("patches a library", dotted, node.lineno))
    for name in forbidden_calls:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                dotted = _dotted(node.func)
                if dotted and (_resolve(dotted, aliases) == name or dotted == name):
                    findings.append(Finding("calls the reference op, which this task forbids", name, node.lineno))
    for node in ast.walk(tree):  # C++ sources handed to load_inline
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(r"#\s*include|__global__|torch::",
                                                                                          node.value):
            for finding in check_c(node.value):
                findings.append(dataclasses.replace(finding, line=node.lineno + finding.line - 1))
    return _dedupe(findings)


def _resolve(dotted: str, aliases: dict[str, str]) -> str:
    head, _, rest = dotted.partition(".")
    base = aliases.get(head, head)
    return f"{base}.{rest}" if rest else base


def _check_module(module: str, line: int, findings: list[Finding]) -> None:
    root = module.split(".")[0]
    if root in PY_FORBIDDEN_MODULES:
        findings.append(Finding(PY_FORBIDDEN_MODULES[root], f"import {module}", line))
    _check_attribute(module, line, findings)


def _check_attribute(dotted: str, line: int, findings: list[Finding]) -> None:
    for prefix, rule in PY_FORBIDDEN_ATTRIBUTES.items():
        if (dotted == prefix or dotted.startswith(prefix + ".") or
                     (prefix.endswith(("exec", "spawn")) and dotted.startswith(prefix))):
            findings.append(Finding(rule, dotted, line))


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen, unique = set(), []
    for finding in sorted(findings, key=lambda f: (f.line, f.name)):
        if (finding.name, finding.line) not in seen:
            seen.add((finding.name, finding.line))
            unique.append(finding)
    return unique


def static_check(code: str, toolchain: int, forbidden_calls: list[str] | tuple[str, ...] = ()) -> list[Finding]:
    if toolchain == Toolchain.TOOLCHAIN_KERNELBENCH:
        return check_python(code, forbidden_calls)
    return check_c(code, forbidden_calls)


def missing_entry_point(code: str, toolchain: int, name: str) -> str | None:
    """Why the code lacks the required entry point, or None when it has it."""
    if toolchain == Toolchain.TOOLCHAIN_KERNELBENCH:
        try:
            tree = ast.parse(code)
        except SyntaxError:
            return None  # the COMPILE stage reports the syntax error with its location
        if not any(isinstance(node, ast.ClassDef) and node.name == "ModelNew" for node in tree.body):
            return "no class ModelNew is defined"
        return None
    clean = strip_c_comments_and_strings(code)
    if not re.search(rf"\b{re.escape(name)}\s*\(", clean):
        return f'no function {name} is defined (declare it extern "C")'
    return None
