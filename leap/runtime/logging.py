"""JSON logs with structlog: one object per line on stderr, with the request id of the call.

`configure_logging` sets the format; `library_output_as_logs` (what `leap serve` runs a
service inside) makes what libraries write keep to it: progress bars off, transformers' and
vLLM's loggers and `warnings` through the JSON handler, and any line a library prints to
stdout or stderr one JSON object. CLI commands (`leap demo`) keep their progress bars.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator

import structlog

LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str = "info", service: str = "") -> None:
    """Log JSON lines at `level` and above; `service` is added to every line."""
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
    numeric = getattr(logging, level.upper())
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if service:
        processors.append(_add_service(service))
    processors += [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Libraries that use the standard logging module (transformers, grpc) log through the
    # same JSON renderer.
    handler = logging.StreamHandler(sys.stderr)
    foreign: list = [structlog.stdlib.add_logger_name, structlog.processors.add_log_level,
                     structlog.processors.TimeStamper(fmt="iso", utc=True)]
    if service:
        foreign.append(_add_service(service))
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(processor=structlog.processors.JSONRenderer(), foreign_pre_chain=foreign)
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(max(numeric, logging.WARNING))


def _add_service(service: str):
    def processor(_logger, _name, event_dict):
        event_dict.setdefault("service", service)
        return event_dict

    return processor


def get_logger(name: str = "leap"):
    return structlog.get_logger(name)


# Read by the libraries when they are imported (and by child processes): no progress bars,
# and vLLM leaves its loggers to the root handler instead of installing its own format.
QUIET_ENVIRONMENT = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1", "VLLM_CONFIGURE_LOGGING": "0"}


@contextlib.contextmanager
def library_output_as_logs() -> Iterator[None]:
    """Inside, a service's log stays one JSON object per line (call after `configure_logging`):

    - progress bars off (`QUIET_ENVIRONMENT`; transformers' and huggingface_hub's switches,
      now or when they are first imported);
    - transformers' own stderr handler removed, so its records reach the JSON root handler;
    - `warnings.warn` logged (logger `py.warnings`);
    - a line a library prints to stdout or stderr becomes one JSON object (`stream`: which);
    - an uncaught exception in a thread is one JSON object with its traceback.

    On exit the streams, warnings and thread hook are as they were, so a command's last
    words after the service stopped (a friendly error) are plain text again.
    """
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    finder = _AfterImport({"transformers.utils.logging": _quiet_transformers,
                           "huggingface_hub.utils": lambda module: module.disable_progress_bars()})
    finder.apply_to_imported()
    sys.meta_path.insert(0, finder)
    streams = sys.stdout, sys.stderr
    hook = threading.excepthook
    logging.captureWarnings(True)
    sys.stdout = _LinesAsLogs("stdout", logging.INFO, streams[0])
    sys.stderr = _LinesAsLogs("stderr", logging.WARNING, streams[1])
    threading.excepthook = _log_thread_exception
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = streams
        threading.excepthook = hook
        logging.captureWarnings(False)
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)


def _quiet_transformers(module) -> None:
    module.disable_progress_bar()
    module.disable_default_handler()
    module.enable_propagation()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `callbacks[name](module)` once module `name` is imported, or at once for one that
    already is: libraries that install their own log handler when they are imported."""

    def __init__(self, callbacks: dict[str, Callable]):
        self.callbacks = dict(callbacks)
        self._lock = threading.Lock()

    def apply_to_imported(self) -> None:
        for name in [n for n in self.callbacks if n in sys.modules]:
            self.callbacks.pop(name)(sys.modules[name])

    def find_spec(self, fullname, path, target=None):
        with self._lock:
            callback = self.callbacks.pop(fullname, None)
        if callback is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            try:
                callback(module)
            except Exception:  # noqa: BLE001 - a library that changed its API: keep its output, not fail the import
                get_logger("leap.runtime").warning("could not route a library's output", module=fullname, exc_info=True)

        spec.loader.exec_module = exec_module
        return spec


class _LinesAsLogs:
    """A text stream whose every line (ended by a newline or a carriage return) is logged."""

    def __init__(self, stream: str, level: int, original):
        self.stream = stream
        self.level = level
        self.original = original
        self.encoding = getattr(original, "encoding", "utf-8")
        self._buffer = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._buffer = re.split(r"[\r\n]", self._buffer + text)
        self._log(lines)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            lines, self._buffer = [self._buffer], ""
        self._log(lines)

    def _log(self, lines: list[str]) -> None:
        logger = get_logger("leap.output")
        for line in lines:
            if line.strip():
                logger.log(self.level, line.rstrip(), stream=self.stream)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:  # C-level writers (faulthandler, child processes) use the real stream
        return self.original.fileno()


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    get_logger("leap.runtime").error("uncaught exception in a thread",
                                     thread=getattr(args.thread, "name", None),
                                     exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
