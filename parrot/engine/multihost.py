"""One engine over several processes or hosts: `jax.distributed` joins them into one set of devices, the
tensor-parallel mesh spans them, and every process runs the same computations.

JAX is multi-controller: each process must launch every computation over the global mesh itself, with
the same inputs. The engine (scheduler, KV bookkeeping, HTTP API) runs in process 0, the leader. The
other processes follow: before the leader's runner launches a device operation (a step, a sampler, a
page copy), it broadcasts the operation and its host inputs to them through JAX's own collectives
(`multihost_utils.broadcast_one_to_all`), and each follower's runner replays it on its shards. Device
arrays an operation takes from an earlier one (the logits a sampler reads, the tokens an ahead step
splices in) are named by the number of the operation that made them (`ModelRunner.replay`).

Command line (sglang's names): `--dist-init-addr HOST:PORT --nnodes K --node-rank R`; on one machine,
CPU processes reach each other over loopback with JAX's gloo collectives.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import numpy as np

if TYPE_CHECKING:
    from parrot.engine.runner import ModelRunner

log = logging.getLogger(__name__)

_MIN_PAYLOAD = 4096  # payload buffers come in powers of two from this size (few broadcast shapes to compile)


@dataclass(frozen=True)
class Cluster:
    """Where this process sits in a multi-process engine."""

    coordinator: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int

    @property
    def leader(self) -> bool:
        return self.process_id == 0


def initialize(cluster: Cluster) -> None:
    """Join the processes (before anything else uses JAX). CPU processes exchange data through gloo."""
    if cluster.num_processes < 1 or not 0 <= cluster.process_id < cluster.num_processes:
        raise ValueError(f"--node-rank must be in [0, {cluster.num_processes}) (got {cluster.process_id})")
    if ":" not in cluster.coordinator:
        raise ValueError(f"--dist-init-addr must be HOST:PORT (got {cluster.coordinator!r})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id)
    log.info("process %d of %d joined at %s: %d devices in all, %d here", cluster.process_id,
             cluster.num_processes, cluster.coordinator, jax.device_count(), jax.local_device_count())


def _broadcast(payload: bytes | None) -> bytes:
    """Process 0's bytes, in every process (the others pass None)."""
    from jax.experimental import multihost_utils

    n = np.array([len(payload) if payload is not None else 0], np.int64)
    n = int(np.asarray(multihost_utils.broadcast_one_to_all(n))[0])
    size = max(_MIN_PAYLOAD, 1 << (n - 1).bit_length())
    buf = np.zeros(size, np.uint8)
    if payload is not None:
        buf[:n] = np.frombuffer(payload, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buf))[:n].tobytes()


class Mirror:
    """The leader's side: sends each device operation to the followers before launching it."""

    def send(self, op: str, args: tuple) -> None:
        _broadcast(pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL))

    def stop(self) -> None:
        self.send("stop", ())


def follow(runner: ModelRunner) -> None:
    """A follower's loop: replay the leader's operations until it stops."""
    log.info("following process 0's engine")
    runner.following = True
    while True:
        op, args = pickle.loads(_broadcast(None))
        if op == "stop":
            log.info("the leader stopped")
            return
        runner.replay(op, args)
