"""A torchrl weight sync scheme backed by a dbsync store: a drop-in for torchrl's
``VLLMDoubleBufferSyncScheme`` (torchrl 0.14.1) with versions, an atomic flip and checks.

    from dbsync.torchrl import VLLMDoubleBufferSyncScheme   # was: torchrl.weight_update.llm

    scheme = VLLMDoubleBufferSyncScheme(remote_addr="/mnt/shared/policy", num_threads=8)
    sender = scheme.create_sender()                # trainer
    sender.register_model(policy_model)
    version = sender.update_weights()              # 1, 2, 3, ...: durable and published

    receiver = scheme.create_receiver(llm)         # inference: a vllm.LLM or AsyncLLM
    if receiver.poll_and_apply():                  # True when a newer version was applied
        print("serving", receiver.version)

The scheme is a ``torchrl.weight_update.WeightSyncScheme``, so it also works wherever torchrl
takes one: ``Collector(..., weight_sync_schemes={"policy": scheme})`` (``init_on_sender``,
``connect``, ``send`` through ``collector.update_policy_weights_``), receiver-side
``init_on_receiver``/``connect``/``receive``, the ``UpdateWeights(sender=...)`` trainer hook,
and the older ``init_on_worker``/``get_sender``/``get_receiver`` calls.

Weight extraction is torchrl's own ``WeightStrategy`` (``strategy="tensordict"`` or
``"state_dict"``), so the same names reach the store as with torchrl's scheme, with one
difference: the ``"tensordict"`` strategy of an ``nn.Module`` leaves out non-persistent buffers
(e.g. rotary ``inv_freq``), which are not weights and which a vLLM engine would refuse.

Where this differs from torchrl's scheme, on purpose:
- torchrl overwrites one directory in place: a reader can load half of two versions. Here each
  push goes to a free slot and a manifest is flipped atomically once it is durable; readers
  lease what they read, and every checksum is verified before the engine sees a tensor.
- torchrl's ``update_weights`` returns nothing and ``poll_and_apply`` always returns True (it
  reloads whatever is in the folder). Here ``update_weights``/``send`` return the published
  version, ``poll_and_apply`` returns whether a newer version was applied, and
  ``receiver.version`` says which version the engine serves.
- torchrl's extraction turns an unsupported source into an empty set with a warning, and its
  scheme cannot be initialized by a collector (``init_on_sender`` raises NotImplementedError).
  Here nothing is skipped: empty or unresolvable weights raise ``InvalidWeightsError``, a
  version the engine's model does not fit raises ``IncompatibleWeightsError`` (the served
  version stays), and ``worker_ids`` (every receiver reads the same store) raises ValueError.

Hazards:
- ``receive()``/``receive_weights()`` do not wait unless given a ``timeout``: they apply a newer
  version if there is one and return None otherwise (torchrl's own reload is immediate too).
- A vLLM engine must be created with ``**dbsync.vllm.engine_args()``; torchrl's Ray-based
  ``AsyncVLLM`` is not supported (attach inside each engine's process, or run
  ``dbsync serve-vllm``). An offline ``vllm.LLM`` is not thread-safe: call ``poll_and_apply``
  between ``generate`` calls, from the thread that generates.
- One writer per store: the scheme keeps one ``dbsync.Sender`` per scheme object and process
  (``create_transport``/``create_sender`` share it); ``shutdown()`` releases it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn

try:
    from tensordict import TensorDict, TensorDictBase
    from torchrl.weight_update.utils import _resolve_model
    from torchrl.weight_update.weight_sync_schemes import WeightStrategy, WeightSyncScheme
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dbsync.torchrl needs torchrl (tested with torchrl 0.14.1): pip install torchrl"
    ) from exc

from .copyplan import MISSING, fit_problems, problem_listing, tied_to_published
from .errors import (
    DBSyncError,
    IncompatibleWeightsError,
    InvalidArgumentError,
    InvalidWeightsError,
    StoreNotFoundError,
    StoreUnreachableError,
    check_flag,
    check_int,
    check_seconds,
)
from .receiver import Receiver
from .sender import Sender
from .sources import check_target_dtype, non_persistent_buffers
from .store import Store
from .watch import Watcher

log = logging.getLogger(__name__)

Strategy = Literal["tensordict", "state_dict"]

__all__ = [
    "DBSyncScheme",
    "DBSyncTransport",
    "DBSyncWeightReceiver",
    "DBSyncWeightSender",
    "VLLMDoubleBufferSyncScheme",
    "VLLMDoubleBufferTransport",
    "VLLMDoubleBufferWeightReceiver",
    "VLLMDoubleBufferWeightSender",
    "extract_weights",
]


# ---- weights ---------------------------------------------------------------------------------
def extract_weights(strategy: WeightStrategy, source: Any) -> Any:
    """``strategy.extract_weights(source)`` (torchrl's extraction, unchanged), except that for an
    ``nn.Module`` under ``"tensordict"`` its non-persistent buffers are left out (they are not
    in its state_dict, not in its checkpoint, and an engine would refuse them)."""
    weights = strategy.extract_weights(source)
    if strategy.extract_as == "tensordict" and isinstance(source, nn.Module):
        dropped = non_persistent_buffers(source)
        if dropped:
            keys = [tuple(name.split(".")) for name in dropped]
            weights = weights.exclude(*keys)
            log.debug("dbsync: not publishing non-persistent buffers %s", sorted(dropped))
    return weights


def _without_non_persistent(weights: TensorDictBase, model: Any) -> TensorDictBase:
    """``weights`` without the registered ``model``'s non-persistent buffers (rotary
    ``inv_freq`` tables: not in its state_dict nor its checkpoint, and an engine refuses
    them), as ``extract_weights`` leaves them out of a module's own extraction."""
    if not isinstance(model, nn.Module):
        return weights
    present = set(weights.keys(include_nested=True, leaves_only=True))
    keys = [key for key in (tuple(name.split(".")) for name in non_persistent_buffers(model))
            if key in present or (len(key) == 1 and key[0] in present)]
    return weights.exclude(*keys) if keys else weights


def _as_pairs(weights: Any) -> dict[str, torch.Tensor]:
    """The flat ``{name: tensor}`` that is published, names joined with '.' (as torchrl's
    ``flatten_keys(".")``)."""
    if isinstance(weights, nn.Module):
        weights = weights.state_dict()
    if isinstance(weights, TensorDictBase):
        flat = weights.flatten_keys(".")
        pairs = {str(k): v for k, v in flat.items(include_nested=True, leaves_only=True)}
    elif isinstance(weights, Mapping):
        if any(isinstance(v, Mapping | TensorDictBase) for v in weights.values()):
            # nested ({"lin": {"weight": ...}}): torchrl's scheme sends it as a TensorDict,
            # which publishes '.'-joined names
            return _as_pairs(TensorDict(dict(weights), batch_size=[]))
        pairs = dict(weights)
    else:
        raise InvalidWeightsError(
            f"cannot publish a {type(weights).__name__}: pass an nn.Module, a TensorDict or a "
            "mapping of names to tensors")
    if not pairs:
        raise InvalidWeightsError(
            "no weights to publish (an empty set): torchrl's extraction returns one for a "
            "source it does not support; pass the model or its state_dict")
    return pairs


# ---- the store ---------------------------------------------------------------------------------
def _published_version(root: str) -> int | None:
    """The store's current version; None if nothing is published or the store does not exist
    yet."""
    try:
        manifest = Store(root).read_manifest()
    except StoreUnreachableError:
        raise  # (there, but its mount failed a read: not "nothing published")
    except StoreNotFoundError:
        return None
    return None if manifest is None else manifest.version


def _wait_for_store(root: str, timeout: float | None) -> bool:
    """Whether ``root`` exists, waiting up to ``timeout`` seconds (None or 0: no wait) for the
    trainer's first push to create it; checked four times a second."""
    if os.path.isdir(root):
        return True
    if not timeout:
        return False
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while (left := deadline - time.monotonic()) > 0:
        pause.wait(min(0.25, left))
        if os.path.isdir(root):
            return True
    return False


# ---- vLLM engines --------------------------------------------------------------------------
def _vllm_engine(target: Any) -> Any | None:
    """``target`` as a vLLM engine (``vllm.LLM``, ``AsyncLLM``, or a torchrl ``vLLMWrapper``
    around one), or None when it is not one."""
    if type(target).__name__ == "AsyncVLLM":
        raise DBSyncError(
            "torchrl's AsyncVLLM runs its engines in Ray actors, which this scheme cannot reach: "
            "attach each engine in its own process (dbsync.vllm.attach) or run "
            "`dbsync serve-vllm`")
    for candidate in (target, getattr(target, "model", None)):
        if candidate is None or isinstance(candidate, nn.Module):
            continue
        if hasattr(candidate, "llm_engine") or asyncio.iscoroutinefunction(
                getattr(candidate, "pause_generation", None)):
            return candidate
    return None


# ---- transport -------------------------------------------------------------------------------
class DBSyncTransport:
    """torchrl's ``VLLMDoubleBufferTransport`` over a dbsync store.

    ``send_weights`` publishes a version into ``remote_addr`` and returns it;
    ``receive_weights`` reads the newest version from ``local_addr`` (the same store, possibly
    mounted elsewhere) if it is newer than the last one received, applies it to ``model`` when
    given one, and returns it as a TensorDict with '.'-joined names (None when nothing is
    newer). A vLLM engine as ``model`` gets the version through dbsync's swap path and the
    version number is returned instead of tensors."""

    def __init__(self, remote_addr: str | os.PathLike[str],
                 local_addr: str | os.PathLike[str] | None = None, num_threads: int = 1, *,
                 scheme: DBSyncScheme | None = None):
        self.remote_addr = os.fspath(remote_addr)
        self.local_addr = os.fspath(local_addr) if local_addr is not None else self.remote_addr
        self.num_threads = num_threads
        self._scheme = scheme
        self._own_writer: Sender | None = None
        self._reader: Receiver | None = None
        self._vllm: DBSyncWeightReceiver | None = None
        self.last_version: int | None = None
        #: weights applied by hand since (``apply_weights``): the next receive applies the
        #: current version again, whatever was received before
        self.overwritten = False

    # -- sender side
    def _writer(self) -> Sender:
        if self._scheme is not None:
            return self._scheme.writer()
        if self._own_writer is None:
            self._own_writer = Sender(self.remote_addr, num_threads=self.num_threads)
        return self._own_writer

    def send_weights(self, *args: Any) -> int:
        """``send_weights(weights)`` (torchrl's scheme ``send``) or ``send_weights(model_id,
        weights)`` (torchrl's double-buffer sender). Returns once the version is durable and
        published; returns the version."""
        if len(args) == 2:
            model_id, weights = args
        elif len(args) == 1:
            model_id, weights = None, args[0]
        else:
            raise TypeError("send_weights(weights) or send_weights(model_id, weights)")
        version = self._writer().push(_as_pairs(weights))
        self.last_version = version
        log.info("dbsync: published version %d of %s to %s", version, model_id or "the model",
                 self.remote_addr)
        return version

    def setup_connection_and_weights_on_sender(self) -> None:
        """Nothing to set up: receivers read the store's current version when they connect."""

    # -- receiver side
    def _receiver(self) -> Receiver:
        if self._scheme is not None:
            self._scheme._check_not_shut_down()
        if self._reader is None:
            verify = True if self._scheme is None else self._scheme.verify
            self._reader = Receiver(self.local_addr, verify=verify)
        return self._reader

    def receive_weights(self, timeout: float | None = None, *, weights: Any = None,
                        model: Any = None, strategy: WeightStrategy | None = None,
                        inplace: bool = True) -> Any | None:
        """Read (and apply to ``model``) the newest version if it is newer than the last one
        received; wait up to ``timeout`` seconds for one (None: do not wait). ``weights`` is
        ignored (the store holds them). ``inplace=False`` replaces the model's tensors (for a
        model on the meta device)."""
        del weights
        if self._scheme is not None:
            self._scheme._check_not_shut_down()
        engine = _vllm_engine(model) if model is not None else None
        if engine is not None:
            if self._vllm is None or self._vllm.engine is not engine:
                if self._scheme is None:
                    raise DBSyncError("a vLLM engine receives through a scheme: "
                                      "scheme.create_receiver(engine)")
                self._vllm = DBSyncWeightReceiver(self._scheme, engine)
            applied = self._vllm.poll(timeout)
            return self._vllm.version if applied else None
        started = time.monotonic()
        if not _wait_for_store(self.local_addr, timeout):
            return None
        if timeout:
            timeout = max(0.0, timeout - (time.monotonic() - started))
        receiver = self._receiver()
        # Newer than the version loaded, or a new run (whose versions may be lower); any
        # version once the model was overwritten by hand.
        if receiver.wait(newer_than=0 if self.overwritten else None,
                         timeout=timeout or 0) is None:
            return None
        copies: dict[str, torch.Tensor] = {}

        def load(pairs: Any) -> None:
            for name, tensor in pairs:
                copies[name] = tensor.clone()  # the store's views are valid only during load
            if model is not None and strategy is not None:
                if isinstance(model, nn.Module):  # (all of it first: never half-applied)
                    (_check_fits if inplace else _check_names_and_shapes)(model, copies)
                # Inside load: the version is reported applied (wait_for_receivers) only after.
                strategy.apply_weights(model, dict(copies), inplace=inplace)

        version = receiver.load(load)
        self.last_version, self.overwritten = version, False
        log.info("dbsync: received version %d from %s", version, self.local_addr)
        return TensorDict(copies, batch_size=[])

    def setup_connection_and_weights_on_receiver(self, *, worker_idx: int | None = None,
                                                 weights: Any = None, model: Any = None,
                                                 strategy: WeightStrategy | None = None) -> None:
        """Apply the store's current version, if any, so a late joiner starts from it. Returns
        None (torchrl then applies nothing more)."""
        del worker_idx
        self.receive_weights(None, weights=weights, model=model, strategy=strategy)

    def check_connection(self) -> bool:
        """Whether the store's directory exists (nothing needs to be published yet)."""
        return os.path.isdir(self.local_addr)

    def close(self) -> None:
        if self._own_writer is not None:
            self._own_writer.close()
            self._own_writer = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._vllm is not None:
            self._vllm.close()
            self._vllm = None


# ---- sender and receiver -----------------------------------------------------------------------
class DBSyncWeightSender:
    """torchrl's ``VLLMDoubleBufferWeightSender``: ``register_model(model)``, then
    ``update_weights()`` publishes the model's current weights and returns the version."""

    def __init__(self, scheme: DBSyncScheme):
        self._scheme = scheme
        self._strategy = scheme.strategy
        self._model_ref: Any = None
        self._transport: DBSyncTransport | None = None

    def register_model(self, model: Any) -> None:
        """Register the model to extract weights from (held by a weak reference)."""
        import weakref

        self._model_ref = weakref.ref(model)
        self._transport = self._scheme.create_transport()
        log.info("dbsync: registered a model for publishing to %s", self._scheme.remote_addr)

    def update_weights(self, weights: Any | None = None) -> int:
        """Publish ``weights`` (default: the registered model's, extracted with the scheme's
        strategy); return the version once it is durable and published."""
        if self._transport is None:
            raise RuntimeError("Transport not initialized. Call register_model first.")
        if weights is None:
            model = self._model_ref()
            if model is None:
                raise RuntimeError("Model reference is dead")
            weights = extract_weights(self._strategy, model)
        elif isinstance(weights, TensorDictBase):  # (``TensorDict.from_module(model)``)
            weights = _without_non_persistent(extract_weights(self._strategy, weights),
                                              self._model_ref())
        elif hasattr(weights, "state_dict"):
            weights = extract_weights(self._strategy, weights)
        version = self._transport.send_weights("vllm_model", weights)
        self._scheme.acknowledged(version)  # (``wait_for``, as ``send``)
        return version

    def wait_for_receivers(self, version: int, count: int, timeout: float | None = None) -> bool:
        """Wait until ``count`` receivers report ``version`` (or newer) applied; False on
        timeout."""
        return self._scheme.writer().wait_for_receivers(version, count, timeout)


class DBSyncWeightReceiver:
    """torchrl's ``VLLMDoubleBufferWeightReceiver`` on dbsync's swap path: each
    ``poll_and_apply()`` applies the newest published version to the engine (read and verified
    before the engine pauses) and says whether it applied one. ``target`` is a ``vllm.LLM`` or
    ``AsyncLLM`` created with ``**dbsync.vllm.engine_args()`` (or a torchrl ``vLLMWrapper``
    around one); an ``nn.Module`` is updated in place through torchrl's strategy. For an
    ``AsyncLLM`` created outside the calling thread's event loop pass its ``loop``, and call
    ``poll_and_apply`` from another thread than that loop's."""

    def __init__(self, scheme: DBSyncScheme, target: Any, *,
                 loop: asyncio.AbstractEventLoop | None = None):
        self._scheme = scheme
        self._strategy = scheme.strategy
        self.engine = _vllm_engine(target)
        self._target = target
        self._loop = loop
        self._transport = scheme.create_transport()
        self._attachment: Any = None
        self._lock = threading.Lock()
        if self.engine is None and not isinstance(target, nn.Module | TensorDictBase | dict):
            raise DBSyncError(
                f"cannot receive into a {type(target).__name__}: pass a vllm.LLM or AsyncLLM "
                "created with **dbsync.vllm.engine_args(), or an nn.Module")
        if self._connect_store():
            log.info("dbsync: receiver reading from %s", scheme.local_addr)
        else:
            log.info("dbsync: %s does not exist yet; the receiver starts reading it once the "
                     "trainer's first push creates it", scheme.local_addr)

    def _connect_store(self) -> bool:
        """Attach the engine (or register the reader) once the store exists; whether it
        does. A receiver may start before the trainer has created the store."""
        if not os.path.isdir(self._scheme.local_addr):
            return False
        if self.engine is None:
            self._transport._receiver()  # registers the reader, as torchrl's does at once
        elif self._attachment is None:
            from .vllm import attach

            scheme = self._scheme
            self._attachment = attach(self.engine, scheme.local_addr, watch=False,
                                      model_dir=scheme.model_dir, verify=scheme.verify,
                                      poll_interval=scheme.poll_interval, loop=self._loop,
                                      transport="filesystem")
        return True

    @property
    def version(self) -> int | None:
        """The version applied (None: nothing applied yet; an engine serves its checkpoint)."""
        if self._attachment is not None:
            return self._attachment.version
        return self._transport.last_version

    def status(self) -> dict[str, Any]:
        """For a vLLM engine: the same JSON ``serve-vllm`` answers on ``/dbsync/status``."""
        if self._attachment is None:
            return {"version": self.version, "root": self._scheme.local_addr}
        return self._attachment.status()

    def _wait_for(self, newer_than: int, timeout: float) -> bool:
        found = threading.Event()

        def on_version(v: int) -> None:
            if v > newer_than:
                found.set()

        with Watcher(self._scheme.local_addr, on_version,
                     poll_interval=self._scheme.poll_interval):
            published = _published_version(self._scheme.local_addr)
            if published is not None and published > newer_than:
                return True
            return found.wait(timeout)

    def poll(self, timeout: float | None = None) -> bool:
        """Apply the newest version if it is newer than the one applied, waiting up to
        ``timeout`` seconds for one (None or 0: do not wait). True if one was applied."""
        with self._lock:
            if self.engine is None:
                got = self._transport.receive_weights(timeout, model=self._target,
                                                      strategy=self._strategy)
                return got is not None
            deadline = time.monotonic() + (timeout or 0)
            if not self._connect_store():
                if not _wait_for_store(self._scheme.local_addr, timeout):
                    return False
                self._connect_store()
            before = self.version
            left = deadline - time.monotonic()
            if left > 0:
                self._wait_for(before or 0, left)
            after = self._attachment.apply_latest()
            return after is not None and after != before

    def poll_and_apply(self, timeout: float = 180.0) -> bool:
        """Apply the newest published version if the engine does not serve it yet; True if a
        version was applied, False if it already serves the newest one. Waits (up to
        ``timeout`` seconds) only while nothing at all has been published; if the store still
        does not exist then, raises ``StoreNotFoundError`` (a wrong path or a missing mount).
        Raises ``IncompatibleWeightsError``/``DamagedVersionError`` when the version is refused
        (the previous one keeps serving)."""
        root = self._scheme.local_addr
        if _published_version(root) is not None:
            return self.poll(None)
        if self.version is not None and not os.path.isdir(root):
            # (the store this engine got version N from is gone: say so now, rather than
            # stall the caller's generate loop for the first-push wait on every poll)
            raise StoreNotFoundError(
                f"{root} no longer exists (removed, or its volume unmounted); the target keeps "
                f"version {self.version}. Check the mount: the next poll reads the "
                "store again once it is back")
        applied = self.poll(timeout)
        if not applied and not os.path.isdir(root):
            raise StoreNotFoundError(
                f"{root} still does not exist after {timeout} s: check the path and that the "
                "volume is mounted (the trainer's first push creates the store)")
        return applied

    def apply_weights(self, weights: Any, inplace: bool = True) -> None:
        """Apply given tensors to an ``nn.Module`` target (torchrl's strategy); ``version``
        is None afterwards, and the next poll applies the current published version again.
        A vLLM engine only applies published versions (verified, versioned): use
        ``poll_and_apply``."""
        if not inplace:
            raise ValueError("Cannot apply weights out of place for vLLM double-buffer")
        if self.engine is not None:
            raise DBSyncError(
                "a vLLM engine applies only published versions: push the weights with the "
                "sender (update_weights) and call poll_and_apply()")
        self._strategy.apply_weights(self._target, weights, inplace=inplace)
        # (the model holds no published version now: the next poll applies the current one)
        self._transport.last_version, self._transport.overwritten = None, True

    def close(self) -> None:
        """Detach from the engine (it keeps the weights it has) and unregister the reader."""
        if self._attachment is not None:
            self._attachment.detach()
            self._attachment = None
        self._transport.close()


class _ReceiverTransport:
    """The transport a receiver-side scheme uses for a vLLM engine: ``receive()`` polls the
    scheme's ``DBSyncWeightReceiver``."""

    def __init__(self, receiver: DBSyncWeightReceiver):
        self.receiver = receiver

    def receive_weights(self, timeout: float | None = None, **_: Any) -> int | None:
        return self.receiver.version if self.receiver.poll(timeout) else None

    def setup_connection_and_weights_on_receiver(self, **_: Any) -> None:
        self.receiver.poll(None)

    def check_connection(self) -> bool:
        return os.path.isdir(self.receiver._scheme.local_addr)


def _copy_into(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` into ``model``'s tensors in place (checked first: ``_check_fits``)."""
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in weights.items():
            state[name].detach().copy_(tensor)


def _check_fits(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Raise ``IncompatibleWeightsError`` listing every problem ``Receiver.load`` would see in
    loading ``weights`` (a version) into ``model`` in place (names, shapes, dtypes, unusable
    tensors; tensors the version lacks unless tied to one it has), before anything is
    applied: torchrl's strategies fail part-way, with the model holding parts of two
    versions."""
    state = {k: v for k, v in model.state_dict(keep_vars=True).items()
             if isinstance(v, torch.Tensor)}
    _refuse_unless_tied(fit_problems([(n, t.shape, t.dtype) for n, t in weights.items()],
                                     state, strict=True), state, weights)


def _refuse_unless_tied(problems: dict[str, str], state: Mapping[str, torch.Tensor],
                        weights: Mapping[str, torch.Tensor]) -> None:
    """Raise ``IncompatibleWeightsError`` for ``problems``, unless they are only tensors the
    version lacks that are tied to ones it has (``tied_to_published``)."""
    if problems and not tied_to_published(problems, state, list(weights)):
        raise IncompatibleWeightsError(
            f"the published version does not fit the model {problem_listing(problems)}; "
            "nothing was applied. Receive into a model of the trainer's architecture",
            problems)


def _check_names_and_shapes(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """``_check_fits`` for a model whose tensors are replaced, not written (a collector
    worker's policy on the meta device): the names and shapes must be the model's, or the
    worker would go on with parameters still on the meta device, or of other shapes."""
    state = {k: v for k, v in model.state_dict(keep_vars=True).items()
             if isinstance(v, torch.Tensor)}
    problems: dict[str, str] = {}
    for name, tensor in weights.items():
        mine = state.get(name)
        if mine is None:
            problems[name] = "not in the model"
        elif tuple(mine.shape) != tuple(tensor.shape):
            problems[name] = (f"shape {list(tensor.shape)} != the model's "
                              f"{list(mine.shape)}")
    problems.update((name, MISSING) for name in state if name not in weights)
    _refuse_unless_tied(problems, state, weights)


# ---- scheme ----------------------------------------------------------------------------------
class DBSyncScheme(WeightSyncScheme):
    """torchrl's ``VLLMDoubleBufferSyncScheme`` (same constructor and methods) over a dbsync
    store; see the module docstring for what differs and why.

    ``remote_addr``: the store the trainer publishes to. ``local_addr``: the same store as the
    receiver sees it (default ``remote_addr``). ``num_threads``: parallel writers.
    ``strategy``: torchrl's weight extraction, "tensordict" or "state_dict".
    dbsync options (keyword-only): ``dtype`` (publish floating tensors in this dtype),
    ``durable`` (fsync before the flip; turn off only for /dev/shm), ``verify`` (check every
    checksum before applying), ``poll_interval`` (force polling the store, e.g. on NFS),
    ``model_dir`` (the checkpoint an engine was started from, when not its model name),
    ``wait_for``/``wait_timeout`` (``send`` waits until that many receivers applied the
    version, like torchrl's acknowledged send; in a multi-process collector it defaults to its
    number of workers), ``connect_timeout`` (how long a collector worker whose policy has no
    weights yet waits at ``connect`` for the first version)."""

    def __init__(
        self,
        remote_addr: str | os.PathLike[str],
        local_addr: str | os.PathLike[str] | None = None,
        num_threads: int = 1,
        strategy: Strategy = "tensordict",
        *,
        dtype: torch.dtype | None = None,
        durable: bool = True,
        verify: bool = True,
        poll_interval: float | None = None,
        model_dir: str | None = None,
        wait_for: int = 0,
        wait_timeout: float | None = 120.0,
        connect_timeout: float = 120.0,
    ):
        super().__init__(strategy=strategy)
        # (checked here, before anything is published: a bad option used to surface only at
        # the first send, or after send() had published the version)
        check_int(num_threads, "num_threads", 1)
        check_target_dtype(dtype, InvalidArgumentError)
        check_flag(durable, "durable")
        check_flag(verify, "verify")
        check_int(wait_for, "wait_for", 0)
        check_seconds(wait_timeout, "wait_timeout", none="wait as long as it takes")
        check_seconds(connect_timeout, "connect_timeout")
        check_seconds(poll_interval, "poll_interval", none="chosen from the store's mount")
        self.remote_addr = os.fspath(remote_addr)
        self.local_addr = os.fspath(local_addr) if local_addr is not None else self.remote_addr
        self.num_threads = num_threads
        self.strategy_name = strategy
        self.dtype = dtype
        self.durable = durable
        self.verify = verify
        self.poll_interval = poll_interval
        self.model_dir = model_dir
        self.wait_for = wait_for
        self.wait_timeout = wait_timeout
        self.version: int | None = None
        self.connect_timeout = connect_timeout
        self._collector_workers = 0
        self._watch_error: BaseException | None = None
        self._writer_obj: Sender | None = None
        self._writer_lock = threading.Lock()
        self._sender: DBSyncWeightSender | None = None
        self._receiver: DBSyncWeightReceiver | None = None
        self._shut_down = False

    # -- torchrl's VLLMDoubleBufferSyncScheme API
    def create_transport(self, **kwargs: Any) -> DBSyncTransport:
        """A transport over this scheme's store (``kwargs`` are accepted and unused, as in
        torchrl). Transports of one scheme share its writer."""
        del kwargs
        transport = DBSyncTransport(self.remote_addr, self.local_addr, self.num_threads,
                                    scheme=self)
        made = getattr(self, "_made_transports", None)
        if made is None:
            made = self._made_transports = weakref.WeakSet()
        made.add(transport)  # (closed by shutdown: their readers' leases)
        return transport

    def create_sender(self) -> DBSyncWeightSender:
        """A sender for the trainer process."""
        return DBSyncWeightSender(self)

    def create_receiver(self, vllm_engine: Any, *,
                        loop: asyncio.AbstractEventLoop | None = None) -> DBSyncWeightReceiver:
        """A receiver applying versions to ``vllm_engine`` (see ``DBSyncWeightReceiver``)."""
        return DBSyncWeightReceiver(self, vllm_engine, loop=loop)

    def _check_not_shut_down(self) -> None:
        if getattr(self, "_shut_down", False):
            raise RuntimeError("this scheme was shut down (its writer lock and readers are "
                               "released); create a new scheme to send or receive again")

    def writer(self) -> Sender:
        """This scheme's ``dbsync.Sender`` (created on first use; holds the writer lock)."""
        with self._writer_lock:  # (checked under the lock: a racing shutdown wins)
            self._check_not_shut_down()
            if self._writer_obj is None:
                self._writer_obj = Sender(self.remote_addr, num_threads=self.num_threads,
                                          dtype=self.dtype, durable=self.durable)
            return self._writer_obj

    # -- torchrl's WeightSyncScheme API (sender side)
    def _init_on_sender_impl(self, model_id: str | None = None, context: Any = None, *,
                             model: Any = None, weights: Any = None, **kwargs: Any) -> None:
        del kwargs  # devices, num_workers, params_map...: one store serves every worker
        self._model_id = model_id
        self.context = context
        if model is not None:
            self.model = model
        if weights is not None:
            self.weights = weights
        if self.wait_for == 0 and isinstance(getattr(context, "num_workers", None), int):
            # A multi-process collector: like torchrl's acknowledged send, send() returns once
            # every worker applied the version.
            self._collector_workers = context.num_workers
        self.shared_transport = self.create_transport()
        self._sender = self.create_sender()
        self._sender._transport = self.shared_transport
        if model is not None:
            self._sender._model_ref = self._model_ref

    def _setup_connection_and_weights_on_sender_impl(self, *, worker_idx: int | None = None,
                                                     weights: Any | None = None) -> None:
        """Publish the initial weights, as torchrl's schemes ship them at ``connect``:
        ``weights``, else the model's (given to ``init_on_sender`` or resolved from the
        context). Without either, or when the model holds no weights (a vLLM wrapper), nothing
        is published and receivers start from the store's current version or their own
        checkpoint (logged)."""
        del worker_idx
        try:
            prepared = self.prepare_weights(weights, self._model_id or "policy",
                                            self._strategy, self.context)
            pairs = _as_pairs(prepared)
        except InvalidWeightsError as exc:
            if weights is not None:
                raise
            log.info("dbsync: connect() publishes no initial version of %r (%s)",
                     self._model_id or "policy", exc)
            return
        self.version = self.shared_transport.send_weights(pairs)

    def prepare_weights(self, weights: Any, model_id: str | None, strategy: WeightStrategy,
                        context: Any = None) -> Any:
        """torchrl's ``prepare_weights`` (weights, else the model resolved from ``context``,
        else the model given to ``init_on_sender``), with ``extract_weights`` for modules. An
        unresolvable model raises instead of sending nothing."""
        if weights is None:
            model = None
            if context is not None:
                try:
                    model = _resolve_model(context, model_id or "policy")
                except (AttributeError, KeyError):
                    model = getattr(context, "_fallback_policy", None) \
                        if (model_id or "policy") == "policy" else None
            if model is None and self._model_ref is not None:
                model = self._model_ref()
            if model is None:
                raise InvalidWeightsError(
                    f"no weights to send for {model_id or 'the model'!r}: pass weights=, or "
                    "give init_on_sender a model= or a context holding it")
            return extract_weights(strategy, model)
        if isinstance(weights, nn.Module):
            return extract_weights(strategy, weights)
        if isinstance(weights, str):
            if context is None:
                raise ValueError(f"Cannot resolve string reference '{weights}' without context")
            return extract_weights(strategy, _resolve_model(context, weights))
        return weights

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> int:
        """Publish ``weights`` (None: the model's, see ``prepare_weights``) as the next
        version; with ``wait_for`` set, also wait until that many receivers applied it.
        Returns the version. Every receiver reads the same store, so ``worker_ids`` cannot
        select some of them: passing it raises ValueError."""
        self._check_not_shut_down()
        if not self.initialized_on_sender:
            raise RuntimeError("Must be initialized on sender before sending weights")
        if not self.synchronized_on_sender:
            raise RuntimeError("Must be synchronized on sender before sending weights")
        if worker_ids is not None:
            raise ValueError(
                "a dbsync store publishes to every receiver: send() cannot target worker_ids "
                f"{worker_ids!r}; call it without worker_ids")
        prepared = self.prepare_weights(weights, self._model_id, self._strategy, self.context)
        here = None if weights is None else self._policy_here()
        if here is not None:
            if isinstance(prepared, TensorDictBase):  # (``TensorDict.from_module(policy)``)
                prepared = _without_non_persistent(prepared, here)
            prepared = _as_pairs(prepared)  # (what is checked is what is sent and copied)
            _check_fits(here, prepared)  # (before anything is published)
        version = self.shared_transport.send_weights(prepared)
        self.version = version
        if here is not None:
            _copy_into(here, prepared)
        self.acknowledged(version)
        return version

    def _policy_here(self) -> nn.Module | None:
        """The model this scheme sends weights for when it runs in this very process (a
        single-process collector's own policy, holding weights), else None. Its receivers
        are elsewhere; without a copy here, the collector went on collecting with the old
        weights while the store held the new ones (torchrl's in-process schemes refuse such
        a collector instead)."""
        context = self.context
        if context is None or isinstance(getattr(context, "num_workers", None), int):
            return None
        try:
            model = _resolve_model(context, self._model_id or "policy")
        except (AttributeError, KeyError, ValueError):
            return None
        if not isinstance(model, nn.Module) or not any(
                p.numel() and not p.is_meta for p in model.parameters()):
            return None
        return model

    def acknowledged(self, version: int) -> None:
        """With ``wait_for`` set (or in a multi-process collector), wait until that many
        receivers applied ``version``; ``TimeoutError`` after ``wait_timeout``."""
        count = self.wait_for or self._collector_workers
        if count > 0 and not self.writer().wait_for_receivers(version, count,
                                                               self.wait_timeout):
            raise TimeoutError(
                f"fewer than {count} receivers applied version {version} within "
                f"{self.wait_timeout} s (see `dbsync status {self.remote_addr}`)")

    # -- torchrl's WeightSyncScheme API (receiver side)
    def _init_on_receiver_impl(self, model_id: str, context: Any = None, *,
                               model: Any = None, vllm_engine: Any = None,
                               worker_idx: int | None = None, **kwargs: Any) -> None:
        del kwargs
        self._model_id = model_id
        self.context = context
        self._worker_idx = worker_idx
        target = vllm_engine if vllm_engine is not None else model
        if target is None and context is not None:
            target = _resolve_model(context, model_id)
        if target is None:
            raise DBSyncError(f"no model to receive {model_id!r} into: pass model= (an "
                              "nn.Module or a vLLM engine) or a context holding it")
        self._receiver = DBSyncWeightReceiver(self, target)
        self.model = target
        if self._receiver.engine is not None:
            self._receiver_transport = _ReceiverTransport(self._receiver)
        else:
            self._receiver_transport = self._receiver._transport

    @property
    def weights(self) -> Any | None:
        """torchrl's ``weights``; None for a vLLM engine (its weights live in the engine)."""
        weights = getattr(self, "_weights", None)
        if weights is not None:
            return weights
        receiver = getattr(self, "_receiver", None)
        if receiver is not None and receiver.engine is not None:
            return None
        return WeightSyncScheme.weights.fget(self)  # type: ignore[attr-defined]

    @weights.setter
    def weights(self, value: Any) -> None:
        self._weights = value

    def _setup_connection_and_weights_on_receiver_impl(
            self, *, worker_idx: int | None = None) -> None:
        """Apply the store's current version (a late joiner starts from it). A model whose
        weights are not materialized yet (a collector worker's policy on the meta device)
        waits up to ``connect_timeout`` for the first version and gets it out of place, as
        torchrl's multi-process scheme does. Inside a collector worker a background thread then
        applies every new version, as torchrl's receivers do."""
        del worker_idx
        receiver = self._receiver
        if receiver is None:
            raise RuntimeError("init_on_receiver() must come before connect()")
        if receiver.engine is not None:
            receiver.poll(None)
            return
        model = self.model
        empty = isinstance(model, nn.Module) and any(
            t.is_meta for t in (*model.parameters(), *model.buffers()))
        got = receiver._transport.receive_weights(
            self.connect_timeout if empty else None, model=model, strategy=self._strategy,
            inplace=not empty)
        if got is None and empty:
            raise TimeoutError(
                f"no version of {self._model_id!r} was published to {self.local_addr} within "
                f"{self.connect_timeout} s, and the worker's policy has no weights")
        if self._worker_idx is not None:
            self._start_background_receiver()

    def receive(self, timeout: float | None = None) -> Any | None:
        """torchrl's ``receive``: apply the newest version if it is newer than the last one
        received (waiting up to ``timeout`` seconds; None: no wait), then pass it on to the
        context (a collector's ``update_policy_weights_``). Returns the weights as a
        TensorDict with '.'-joined names (for a vLLM engine: the version), or None."""
        self._check_not_shut_down()
        if not self.initialized_on_receiver:
            raise RuntimeError("Must be initialized on receiver before receiving weights")
        if not self.synchronized_on_receiver:
            raise RuntimeError("Must be synchronized on receiver before receiving weights")
        transport = self.receiver_transport
        if transport is None:
            return None
        result = transport.receive_weights(timeout=timeout, weights=self.weights,
                                           model=self.model, strategy=self._strategy)
        if result is None or not isinstance(result, TensorDictBase):
            return result
        context = self.context
        if context is not None and hasattr(context, "update_policy_weights_"):
            context.update_policy_weights_(model_id=self._model_id or "policy",
                                           policy_or_weights=result.unflatten_keys("."))
        return result

    def _background_receive_loop(self) -> None:
        """Apply each new version as it is published (a watcher on the store, checked at least
        once a second for the stop request). Errors are logged and kept in ``watch_error``."""
        assert self._stop_event is not None
        noticed = threading.Event()
        watcher = Watcher(self.local_addr, lambda _v: noticed.set(),
                          poll_interval=self.poll_interval).start()
        try:
            while not self._stop_event.is_set():
                if not noticed.wait(1.0):
                    continue
                noticed.clear()
                try:
                    self.receive()
                except Exception as exc:  # noqa: BLE001 - reported, and the next version retries
                    self._watch_error = exc
                    log.error("dbsync: applying a new version of %r failed: %s",
                              self._model_id, exc)
        finally:
            watcher.stop()

    @property
    def watch_error(self) -> BaseException | None:
        """The last error of the background receiver (None: none)."""
        return self._watch_error

    # -- torchrl 0.10's API
    def init_on_worker(self, model_id: str, context: Any = None, **kwargs: Any) -> None:
        """torchrl 0.10's name for ``init_on_receiver``."""
        self.init_on_receiver(model_id=model_id, context=context, **kwargs)

    def get_sender(self) -> DBSyncWeightSender:
        if not self.initialized_on_sender or self._sender is None:
            raise RuntimeError(
                f"Must call init_on_sender() before get_sender() on {type(self).__name__}")
        return self._sender

    def get_receiver(self) -> DBSyncWeightReceiver:
        if not self.initialized_on_receiver or self._receiver is None:
            raise RuntimeError(
                f"Must call init_on_worker() before get_receiver() on {type(self).__name__}")
        return self._receiver

    # -- lifecycle
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for key in ("_writer_obj", "_sender", "_receiver", "_receiver_transport",
                    "_shared_transport", "_sender_transports", "_watch_error",
                    "_made_transports"):
            state[key] = None
        state["_writer_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._writer_lock = threading.Lock()

    def shutdown(self) -> None:
        """Release the writer lock, detach receivers; safe to call twice. Sending or receiving
        afterwards raises ``RuntimeError``."""
        with self._writer_lock:
            self._shut_down = True
        super().shutdown()
        senders = getattr(self, "_sender_transports", None)
        owned = (getattr(self, "_shared_transport", None),
                 getattr(self, "_receiver_transport", None),
                 *(senders.values() if isinstance(senders, dict) else ()),
                 *list(getattr(self, "_made_transports", None) or ()))
        for transport in {id(t): t for t in owned if isinstance(t, DBSyncTransport)}.values():
            transport.close()  # (its reader's lease, a writer of its own)
        receiver = getattr(self, "_receiver", None)
        if receiver is not None:
            self._receiver = None
            receiver.close()
        writer = getattr(self, "_writer_obj", None)
        if writer is not None:
            self._writer_obj = None
            writer.close()


# torchrl's names, for a one-line migration.
VLLMDoubleBufferSyncScheme = DBSyncScheme
VLLMDoubleBufferTransport = DBSyncTransport
VLLMDoubleBufferWeightSender = DBSyncWeightSender
VLLMDoubleBufferWeightReceiver = DBSyncWeightReceiver
