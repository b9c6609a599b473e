"""LoRA adapter versions for vLLM: check, materialise and follow the adapters a store holds.

A store of kind ``adapter`` (``Sender.push(peft_dir)`` or ``Sender.push(lora_tensors,
adapter_config={...})``) holds one PEFT adapter per version. This module turns each new
version into something vLLM serves without touching the base weights and without pausing
generation:

1. open the current version through a ``Receiver`` (a lease on its slot), verify every
   checksum;
2. check that it fits the served model (``check_adapter``): PEFT LoRA keys, rank at most the
   engine's ``max_lora_rank``, every target module a linear layer of the base checkpoint, every
   ``lora_A``/``lora_B`` shape equal to what that layer needs (an adapter of another base
   model has other shapes). A version that does not fit is refused with the reason
   (``AdapterRefusedError``, reported in the reader's lease so ``dbsync push --wait-for``
   sees it) and the previous version keeps serving;
3. materialise it as a private PEFT directory (``adapter_config.json`` +
   ``adapter_model.safetensors``) written from the verified snapshot, and hand vLLM a
   ``LoRARequest`` with a fresh ``lora_int_id`` and a per-version ``lora_name``
   (``NAME@vN#ID``).

Why distinct ids and names per version: vLLM's prefix-cache block hashes include the adapter's
name and path, its batches collect adapters in sets keyed by name, and its worker cache is
keyed by id. One name for every version would let a batch holding requests of two versions
run both on one of them, and cached prefixes of one version serve the next.

``AdapterVersions`` keeps the last ``keep`` versions; an older one is dropped from the engine
and its directory deleted once no request that started on it is still running (the server
counts them; vLLM reloads a dropped adapter from its directory if a request still needs it).

Hazards:
- ``keep`` (``--max-loras``) should be at least the trainer's staleness + 1: requests admitted
  on a version that has since been dropped from the engine reload it (a few ms per step
  for a small adapter) while vLLM's LRU cache churns.
- ``LoRAAttachment`` (offline ``vllm.LLM``) drops versions between ``latest()`` calls: a
  ``LoRARequest`` more than ``keep`` versions old must not be passed to ``generate`` again.
- The base model's name in ``adapter_config.json`` (``base_model_name_or_path``) is not
  compared with the served model (a local directory and a hub id name the same model
  differently); the shapes decide.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..adapters import read_adapter
from ..errors import (
    DamagedVersionError,
    DBSyncError,
    IncompatibleWeightsError,
    NothingPublishedError,
    StoreUnreachableError,
)
from ..receiver import Receiver, Snapshot
from ..serveargs import LORA_WORKDIR_ENV
from ..sources import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from . import workdirs

log = logging.getLogger(__name__)

#: PEFT's key format: ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``
#: modules dbsync does not serve adapters of (vLLM handles them specially or not at all)
_UNSUPPORTED_LEAVES = ("embed_tokens", "lm_head")
#: ``lora_int_id``s start far above those vLLM's own ``/v1/load_lora_adapter`` hands out
_IDS = itertools.count(1_000_001)
_IDS_LOCK = threading.Lock()

Expected = Mapping[str, tuple[tuple[int, ...], Any]]


class AdapterRefusedError(IncompatibleWeightsError):
    """A published adapter version does not fit the served model or engine. Nothing was
    loaded; the previous version (if any) keeps serving."""


def next_lora_id() -> int:
    with _IDS_LOCK:
        return next(_IDS)


# ---- checking -------------------------------------------------------------------------------
def linear_layers(expected: Expected) -> dict[str, tuple[int, int]]:
    """Module name -> (out_features, in_features) of every 2-D ``.weight`` of the base
    checkpoint that an adapter may target (embeddings and the LM head excluded)."""
    out: dict[str, tuple[int, int]] = {}
    for name, (shape, _dtype) in expected.items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name[: -len(".weight")]
        if module.rsplit(".", 1)[-1] in _UNSUPPORTED_LEAVES:
            continue
        out[module] = (int(shape[0]), int(shape[1]))
    return out


def check_adapter(config: Mapping[str, Any] | None,
                  tensors: list[tuple[str, tuple[int, ...], torch.dtype]],
                  expected: Expected, max_rank: int) -> dict[str, str]:
    """Problems (what -> why) that keep this adapter from being served on a model whose
    checkpoint has ``expected`` (name -> (shape, dtype)) by an engine whose ``max_lora_rank``
    is ``max_rank``; empty when it fits. (What holds whatever the model is
    ``dbsync.adapters.read_adapter``'s, checked at push time too.)"""
    if config is None:
        return {"kind": "the store holds full weights, not LoRA adapters: serve it without "
                        "--lora (or publish adapters into another ROOT)"}
    adapter = read_adapter(config, tensors)
    problems = dict(adapter.problems)
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        problems["peft_type"] = f"{peft_type!r} adapters are not served (only LORA)"
    highest = adapter.highest_rank
    if highest is not None and highest > max_rank:
        problems["r"] = (f"rank {highest} is above the engine's max_lora_rank {max_rank}; "
                         f"restart the server with --max-lora-rank {highest} or more (after "
                         "'--')")
    if config.get("use_dora"):
        problems["use_dora"] = "DoRA adapters are not served"
    if config.get("modules_to_save"):
        problems["modules_to_save"] = ("adapters that also train whole modules "
                                       f"({config['modules_to_save']}) are not served")
    layers = linear_layers(expected)
    leaves = sorted({m.rsplit(".", 1)[-1] for m in layers})
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for target in targets:
            leaf = str(target).rsplit(".", 1)[-1]
            if leaf not in leaves:
                problems[f"target_modules[{target!r}]"] = (
                    f"not a linear layer of the served model (its linear layers: "
                    f"{', '.join(leaves)})")
    for module, got in adapter.parts.items():
        if module not in layers:
            leaf = module.rsplit(".", 1)[-1]
            for part in got:
                problems[f"base_model.model.{module}.{part}.weight"] = (
                    f"module {module!r} is not a linear layer of the served model"
                    + (" (adapters of embeddings and the LM head are not served)"
                       if leaf in _UNSUPPORTED_LEAVES else ""))
            continue
        if module in problems:  # (the pair itself does not hold together)
            continue
        out_f, in_f = layers[module]
        a, b = got["lora_A"], got["lora_B"]
        r = a[0]
        if a != (r, in_f) or b != (out_f, r):
            problems[module] = (f"shapes lora_A {list(a)}, lora_B {list(b)} do not fit the "
                                f"served layer ({out_f} x {in_f}): an adapter of another base "
                                "model")
    return problems


_FINITE_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def non_finite(pairs: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Problems for tensors holding NaN or infinite values: served, such an adapter answers
    nothing useful (and on vLLM's CPU backend it spoiled the next request of the base model).
    Adapters are small: every value is looked at."""
    problems = {}
    for name, t in pairs:
        values = t if t.dtype in _FINITE_CHECKED else t.float()  # (float8: no isfinite)
        bad = int(t.numel() - torch.isfinite(values).sum())
        if bad:
            problems[name] = f"{bad} of its {t.numel()} values are NaN or infinite"
    return problems


def _refusal(version: int, problems: dict[str, str], serving: str) -> AdapterRefusedError:
    listing = "; ".join(f"{k}: {v}" for k, v in list(problems.items())[:8])
    more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
    return AdapterRefusedError(
        f"adapter version {version} does not fit the served model ({len(problems)} "
        f"problem(s)): {listing}{more}. {serving}", problems)


# ---- versions -------------------------------------------------------------------------------
@dataclass
class AdapterVersion:
    """One materialised adapter version and the ``LoRARequest`` that serves it."""

    version: int
    run_id: str
    rank: int
    nbytes: int
    directory: str
    request: Any  # vllm.lora.request.LoRARequest
    loaded_at: float = field(default_factory=time.time)

    @property
    def lora_int_id(self) -> int:
        return int(self.request.lora_int_id)

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, "run_id": self.run_id, "lora_int_id": self.lora_int_id,
                "lora_name": self.request.lora_name, "rank": self.rank, "bytes": self.nbytes,
                "loaded_at": self.loaded_at}


def _lora_request(name: str, lora_id: int, directory: str) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, directory)


#: the free space ``/dev/shm`` needs to be chosen (a container's default is 64 MiB: adapters
#: kept ``--max-loras`` times would soon fill it)
SHM_MIN_FREE = 256 << 20


def default_workdir() -> str:
    """Where materialised adapters go: ``$DBSYNC_LORA_WORKDIR`` if set; else ``/dev/shm``
    (RAM) when it is writable with ``SHM_MIN_FREE`` free; else the temp dir. Directories a
    killed server left there are removed first (``workdirs``)."""
    base = os.environ.get(LORA_WORKDIR_ENV) or None
    if base is not None:
        os.makedirs(base, exist_ok=True)
    elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize >= SHM_MIN_FREE:
            base = "/dev/shm"
        else:
            log.info("dbsync: /dev/shm has %.0f MiB free (a container's default?): adapters "
                     "go to the temp directory instead (set %s to choose)",
                     st.f_bavail * st.f_frsize / 2**20, LORA_WORKDIR_ENV)
    return workdirs.make("dbsync-lora-", base)


class AdapterVersions:
    """Follows the adapter versions of the store at ``root`` for the served adapter ``name``.

    ``prepare()`` opens, verifies, checks and materialises the current version (the slow
    part, no engine involved); ``commit(v)`` makes it the newest served version once the
    engine has it, and returns the versions that fell out of the last ``keep``. Thread-safe.
    Each prepared directory lives under a private work directory removed by ``close()``."""

    def __init__(self, root: str | os.PathLike[str], name: str, expected: Expected,
                 max_rank: int, keep: int = 2, reader_id: str | None = None,
                 verify: bool = True, workdir: str | None = None):
        if not name or "@" in name or "/" in name:
            raise DBSyncError(f"adapter name {name!r} must be non-empty, without '@' or '/'")
        if keep < 1:
            raise DBSyncError("keep (--max-loras) must be at least 1")
        self.name = name
        self.expected = dict(expected)
        self.max_rank = int(max_rank)
        self.keep = int(keep)
        self.receiver = Receiver(root, reader_id=reader_id, verify=verify)
        if workdir is not None:  # (a private directory inside it: close() removes only that)
            os.makedirs(workdir, exist_ok=True)
        self.workdir = workdirs.make("dbsync-lora-", workdir) if workdir else default_workdir()
        self.kept: list[AdapterVersion] = []
        self.refused: dict[str, Any] | None = None
        self.refusals = 0
        self._refused_key: tuple[str, int] | None = None
        self._in_flight: Counter[int] = Counter()
        self._retiring: dict[int, AdapterVersion] = {}
        self._lock = threading.RLock()
        self._closed = False

    @property
    def root(self) -> str:
        return self.receiver.store.root

    @property
    def current(self) -> AdapterVersion | None:
        with self._lock:
            return self.kept[-1] if self.kept else None

    def published(self) -> tuple[str, int] | None:
        """(run id, version) the store's head names, or None (reads one small file)."""
        head = self.receiver.store.read_head()
        return None if head is None else (head.run_id, head.version)

    def is_current(self, head: tuple[str, int] | None) -> bool:
        cur = self.current
        return head is not None and cur is not None and (cur.run_id, cur.version) == head

    def prepare(self) -> AdapterVersion | None:
        """Materialise the store's current version; None when it is already the newest served
        one or was refused before. Raises ``AdapterRefusedError`` (reported in the lease) when
        it does not fit, ``NothingPublishedError`` when nothing is published yet, and store
        errors (``DamagedVersionError``, ``OSError``) as they come."""
        head = self.published()
        if head is None:
            raise NothingPublishedError(f"no adapter has been published in {self.root} yet")
        if self.is_current(head) or head == self._refused_key:
            return None
        try:
            opened = self.receiver.open()
        except DamagedVersionError as exc:  # its slot's stamp is damaged: as verification
            if exc.version != head[1]:  # (the head moved meanwhile: the next look decides)
                raise
            raise self._refuse_key(head, AdapterRefusedError(
                f"adapter version {exc.version} is damaged: {exc}. The previous adapter keeps "
                "serving", exc.damaged)) from None
        with opened as snap:
            problems = check_adapter(snap.manifest.adapter, [
                (e.name, tuple(e.shape), e.torch_dtype) for e in snap.manifest.tensors],
                self.expected, self.max_rank)
            if problems:
                raise self._refuse(snap, problems)
            if self.receiver.verify or not snap.leased:
                try:
                    snap.verify()
                except DamagedVersionError as exc:  # refused like a full version: reading
                    # it again cannot repair it; the trainer hears of it at once
                    raise self._refuse(snap, exc.damaged, AdapterRefusedError(
                        f"adapter version {snap.version} is damaged: {exc}. "
                        f"{self._serving()}", exc.damaged)) from None
            problems = non_finite(snap.tensors())
            if problems:
                raise self._refuse(snap, problems)
            directory = None
            try:
                directory = tempfile.mkdtemp(prefix=f"v{snap.version}-", dir=self.workdir)
                _write_peft_dir(snap, dict(snap.manifest.adapter or {}), directory)
                snap.check_unchanged()
            except OSError as exc:
                if directory is not None:
                    shutil.rmtree(directory, ignore_errors=True)
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                shm = " (docker --shm-size)" if self.workdir.startswith("/dev/shm") else ""
                raise DBSyncError(
                    f"no room for adapter version {snap.version} "
                    f"({snap.manifest.total_bytes / 2**20:.1f} MiB) in {self.workdir}, where "
                    f"served adapters are written ({exc.strerror}); {self._serving()}. Give "
                    f"it more room{shm}, or set {LORA_WORKDIR_ENV} to a directory with "
                    "room") from None
            except BaseException:
                if directory is not None:
                    shutil.rmtree(directory, ignore_errors=True)
                raise
            lora_id = next_lora_id()
            request = _lora_request(self.request_name(snap.version, lora_id), lora_id,
                                    directory)
            rank = int((snap.manifest.adapter or {}).get("r", 0))
            return AdapterVersion(snap.version, snap.run_id, rank, snap.manifest.total_bytes,
                                  directory, request)

    def request_name(self, version: int, lora_id: int) -> str:
        """The engine's name of one version of this adapter (``NAME@vN#ID``): internal;
        clients name the adapter ``NAME``."""
        return f"{self.name}@v{version}#{lora_id}"

    def is_request_name(self, name: Any) -> bool:
        """Whether ``name`` is a ``request_name`` of this adapter (of any version)."""
        return isinstance(name, str) and name.startswith(f"{self.name}@v")

    def _serving(self) -> str:
        """What serves meanwhile, for a refusal's message."""
        current = self.current
        if current is None:
            return (f"No version of adapter {self.name!r} is served yet: requests naming it "
                    "get 404 until one that fits is published")
        return f"Version {current.version} of the adapter keeps serving"

    def _refuse(self, snap: Snapshot, problems: dict[str, str],
                error: AdapterRefusedError | None = None) -> AdapterRefusedError:
        return self._refuse_key((snap.run_id, snap.version),
                                error or _refusal(snap.version, problems, self._serving()))

    def _refuse_key(self, key: tuple[str, int], error: AdapterRefusedError
                    ) -> AdapterRefusedError:
        """Record ``error`` as the refusal of version ``key`` (run id, version): reported in
        the lease, logged once, not retried until the store names another version."""
        with self._lock:
            self._refused_key = key
            self.refusals += 1
            self.refused = {"version": key[1], "reason": str(error), "at": time.time()}
        self.receiver.report_refusal(key[1], str(error))
        log.warning("dbsync: %s", error)
        return error

    def refuse(self, prepared: AdapterVersion, reason: str) -> AdapterRefusedError:
        """Record that the engine refused ``prepared`` (``reason``) and delete its directory."""
        shutil.rmtree(prepared.directory, ignore_errors=True)
        error = AdapterRefusedError(
            f"adapter version {prepared.version} was refused by vLLM: {reason}. "
            f"{self._serving()}", {"vllm": reason})
        with self._lock:
            self._refused_key = (prepared.run_id, prepared.version)
            self.refusals += 1
            self.refused = {"version": prepared.version, "reason": str(error),
                            "at": time.time()}
        self.receiver.report_refusal(prepared.version, str(error))
        log.warning("dbsync: %s", error)
        return error

    def commit(self, prepared: AdapterVersion) -> list[AdapterVersion]:
        """Make ``prepared`` the newest served version (acknowledged in the lease); return the
        versions beyond the last ``keep``, which the caller drops from the engine and then
        passes to ``retire``."""
        with self._lock:
            prepared.loaded_at = time.time()
            self.kept.append(prepared)
            evicted, self.kept = self.kept[:-self.keep], self.kept[-self.keep:]
            if self.refused is not None and self.refused["version"] <= prepared.version:
                self.refused = None
        self.receiver.mark_loaded(prepared.version, prepared.run_id)
        return evicted

    def retire(self, old: AdapterVersion) -> None:
        """Delete ``old``'s directory now, or when its last running request ends."""
        with self._lock:
            if self._in_flight[old.lora_int_id] > 0:
                self._retiring[old.lora_int_id] = old
                return
        shutil.rmtree(old.directory, ignore_errors=True)

    def acquire_request(self, request: Any) -> AdapterVersion | None:
        """A request starts on ``request`` (the ``LoRARequest`` its model name resolved to
        when it arrived): count it (its version's directory stays until it ends) and return
        its version, which the request must run on. A request that waited while its version
        was dropped from the engine (newer versions came) runs on the newest version instead,
        as if it had arrived a moment later: the dropped one is no longer loaded, and its
        directory stays only for the requests already running on it. None for an adapter not
        of this store (not counted)."""
        lora_id = getattr(request, "lora_int_id", None)
        with self._lock:  # (kept only: a retiring version was removed from the engine)
            found = next((v for v in self.kept if v.lora_int_id == lora_id), None)
            if found is None and self.kept and self.is_request_name(
                    getattr(request, "lora_name", None)):
                found = self.kept[-1]
            if found is not None:
                self._in_flight[found.lora_int_id] += 1
            return found

    def release(self, lora_int_id: int) -> None:
        """A request on ``lora_int_id`` ended."""
        with self._lock:
            self._in_flight[lora_int_id] -= 1
            if self._in_flight[lora_int_id] > 0:
                return
            del self._in_flight[lora_int_id]
            old = self._retiring.pop(lora_int_id, None)
        if old is not None:
            shutil.rmtree(old.directory, ignore_errors=True)

    def in_flight(self, lora_int_id: int) -> int:
        with self._lock:
            return self._in_flight[lora_int_id]

    def status(self) -> dict[str, Any]:
        with self._lock:
            cur = self.kept[-1] if self.kept else None
            return {
                "name": self.name,
                "version": None if cur is None else cur.version,
                "run_id": None if cur is None else cur.run_id,
                "lora_int_id": None if cur is None else cur.lora_int_id,
                "loaded_at": None if cur is None else cur.loaded_at,
                "kept": [dict(v.describe(), in_flight=self._in_flight[v.lora_int_id])
                         for v in self.kept],
                "retiring": [dict(v.describe(), in_flight=self._in_flight[v.lora_int_id])
                             for v in self._retiring.values()],
                "keep": self.keep, "max_lora_rank": self.max_rank,
                "refused": self.refused, "refusals": self.refusals,
            }

    def close(self) -> None:
        """Remove the lease and every materialised directory. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self.receiver.close()
        workdirs.remove(self.workdir)


def _write_peft_dir(snap: Snapshot, config: dict[str, Any], directory: str) -> None:
    """Write the verified version as ``adapter_config.json`` + ``adapter_model.safetensors``,
    straight from the snapshot's views (no intermediate copy)."""
    _write_safetensors(os.path.join(directory, ADAPTER_WEIGHTS), list(snap.tensors()))
    with open(os.path.join(directory, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f)


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3",
              torch.float8_e5m2: "F8_E5M2"}


def _write_safetensors(path: str, pairs: list[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file (8-byte header length, JSON header, raw bytes) written from
    ``pairs`` in order. ``safetensors.torch.save_file`` would refuse views that share one
    mapping and build the whole file in memory first."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in pairs:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, t in pairs:
            if t.numel():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


# ---- engine facts ---------------------------------------------------------------------------
def lora_limits(vllm_config: Any) -> tuple[int, int]:
    """(max_lora_rank, max_loras) of an engine; raises ``DBSyncError`` when LoRA is off."""
    lora_config = getattr(vllm_config, "lora_config", None)
    if lora_config is None:
        raise DBSyncError("this engine was created without LoRA: pass enable_lora=True, "
                          "max_loras=2 (or more) and max_lora_rank=R (the adapters' rank or "
                          "more) to vllm.LLM / AsyncEngineArgs")
    return int(lora_config.max_lora_rank), int(lora_config.max_loras)


def expected_of(vllm_config: Any, model_dir: str | None = None) -> Expected:
    from ..serveargs import resolve_model_dir
    from .checkpoint import expected_from_checkpoint

    model_config = vllm_config.model_config
    expected, _ = expected_from_checkpoint(resolve_model_dir(model_dir or model_config.model),
                                           None)
    return expected


# ---- offline LLM ----------------------------------------------------------------------------
class LoRAAttachment:
    """Follows a store of adapters for an in-process ``vllm.LLM`` (or ``AsyncLLM``): ``latest()``
    returns the ``LoRARequest`` of the newest served version, loading a newer published one
    first. Use it for each ``generate`` call::

        adapter = dbsync.vllm.attach(llm, ROOT, lora="policy")
        outputs = llm.generate(prompts, params, lora_request=adapter.latest())

    A version that does not fit is refused (logged, reported in the lease, ``status()``) and
    the previous one keeps being returned; if none was served yet, ``latest()`` raises the
    refusal. For a ``vllm.LLM`` each new version is loaded into the engine at once and the one
    falling out of the last ``keep`` (default: the engine's ``max_loras``) is dropped; an
    ``AsyncLLM`` loads adapters on first use. Call ``latest()`` from the thread that calls
    ``generate`` (vLLM's offline client is not thread-safe). A new version that cannot be
    read (damaged, an I/O error) is logged and ``latest()`` keeps returning the current one
    (``status()["last_error"]``).

    Hazard (``AsyncLLM``): a dropped version's directory is deleted at once, so a request
    must not still run when ``keep`` newer versions have been loaded since it started."""

    def __init__(self, engine: Any, root: str | os.PathLike[str], name: str, *,
                 keep: int | None = None, model_dir: str | None = None, verify: bool = True,
                 reader_id: str | None = None):
        vllm_config = _vllm_config(engine)
        max_rank, max_loras = lora_limits(vllm_config)
        self.engine = engine
        self._sync_engine = getattr(engine, "llm_engine", None)
        self.versions = AdapterVersions(root, name, expected_of(vllm_config, model_dir),
                                        max_rank, keep=keep or max(2, max_loras),
                                        reader_id=reader_id, verify=verify)
        #: the last store error met by ``latest()`` (the current version kept serving)
        self.last_error: str | None = None
        #: the last new version's ``prepare_s`` (open, verify, check, write) and ``add_lora_s``
        self.timings: dict[str, float] = {}

    @property
    def version(self) -> int | None:
        cur = self.versions.current
        return None if cur is None else cur.version

    def latest(self) -> Any:
        """The ``LoRARequest`` of the newest version (applying a newer published one first)."""
        t0 = time.perf_counter()
        try:
            prepared = self.versions.prepare()
        except AdapterRefusedError:
            if self.versions.current is None:
                raise
            prepared = None
        except (DBSyncError, OSError) as exc:
            # a damaged or unreadable new version: keep serving the current one, say so
            if self.versions.current is None or (isinstance(exc, NothingPublishedError) and
                                                 not isinstance(exc, StoreUnreachableError)):
                raise  # (nothing there at all; a mount's passing error keeps the current one)
            reason = f"{type(exc).__name__}: {exc}"
            if reason != self.last_error:
                log.warning("dbsync: adapter %s: %s; version %d keeps serving",
                            self.versions.name, reason, self.versions.current.version)
            self.last_error = reason
            prepared = None
        if prepared is not None:
            t1 = time.perf_counter()
            if self._sync_engine is not None:
                try:
                    self._sync_engine.add_lora(prepared.request)
                except Exception as exc:  # noqa: BLE001 - vLLM's own refusal, reported
                    error = self.versions.refuse(prepared, f"{type(exc).__name__}: {exc}")
                    if self.versions.current is None:
                        raise error from exc
                    prepared = None
            if prepared is not None:
                self.last_error = None
                self.timings = {"prepare_s": t1 - t0, "add_lora_s": time.perf_counter() - t1}
                for old in self.versions.commit(prepared):
                    if self._sync_engine is not None:
                        with contextlib.suppress(Exception):
                            self._sync_engine.remove_lora(old.lora_int_id)
                    self.versions.retire(old)
                log.info("dbsync: serving adapter %s version %d (lora_int_id %d)",
                         self.versions.name, prepared.version, prepared.lora_int_id)
        cur = self.versions.current
        assert cur is not None
        return cur.request

    def status(self) -> dict[str, Any]:
        return {**self.versions.status(), "last_error": self.last_error,
                "timings": self.timings}

    def detach(self) -> None:
        """Unregister the reader and delete the materialised adapters (after the last
        ``generate`` that uses them)."""
        self.versions.close()

    close = detach

    def __enter__(self) -> LoRAAttachment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


def _vllm_config(engine: Any) -> Any:
    for path in (("llm_engine", "vllm_config"), ("vllm_config",)):
        obj = engine
        for attr in path:
            obj = getattr(obj, attr, None)
        if obj is not None:
            return obj
    raise DBSyncError(f"{type(engine).__name__} is not a vllm.LLM or AsyncLLM")


def attach_lora(engine: Any, root: str | os.PathLike[str], name: str,
                **kwargs: Any) -> LoRAAttachment:
    """``dbsync.vllm.attach(engine, ROOT, lora=NAME)``: see ``LoRAAttachment``."""
    return LoRAAttachment(engine, root, name, **kwargs)
