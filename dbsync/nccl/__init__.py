"""Broadcast fast path: NCCL (GPUs) or gloo (CPUs) delivery of each pushed version to the
receivers that joined the sender's group, with the filesystem as source of truth and fallback.

    sender = BroadcastSender(Sender(root), device="cuda:0")   # or device="cpu" for gloo
    sender.push(model)                      # broadcast, then publish to the filesystem

    receiver = BroadcastReceiver(root, device="cuda:0")
    receiver.receive(load_weights)          # broadcast if in the group, else filesystem

    receive_weights(root, load_weights)     # the same, one cached receiver per process

Rendezvous: ``ROOT/broadcast.json`` (see ``rendezvous.py``). Nothing here uses pickle.
"""

from .errors import BroadcastError, BroadcastTimeoutError, RendezvousError
from .layout import DEFAULT_BUCKET_BYTES
from .receiver import BroadcastReceiver, close_receivers, receive_weights
from .rendezvous import RENDEZVOUS_FILE, RendezvousRecord, read_record
from .sender import DEFAULT_TIMEOUT, BroadcastSender

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_TIMEOUT",
    "RENDEZVOUS_FILE",
    "BroadcastError",
    "BroadcastReceiver",
    "BroadcastSender",
    "BroadcastTimeoutError",
    "RendezvousError",
    "RendezvousRecord",
    "close_receivers",
    "read_record",
    "receive_weights",
]
