"""Starting and stopping the ranks of a tensor-parallel engine.

Owns :class:`WorkerSpec` (everything a rank needs to build the same runner as rank 0),
:func:`start_tp` (rank 0: check the head split, then join the group or spawn the ranks),
:func:`build_worker` (a rank other than 0 of a group the caller made), :func:`dist_rank`,
:class:`TPSession` (rank 0's handle on the group: the processes it spawned, STOP at shutdown, the
step records) and the spawned ranks' entry point.

Dependencies run one way: the engine imports this package, never the reverse. What only the engine
knows how to do (load a model, build its runner and host pool) reaches a rank as
:attr:`WorkerSpec.build`, a function of the engine's that the spec carries (by reference, so it
pickles to spawned ranks); :attr:`WorkerSpec.config` is the engine's
:class:`~pagedkv.engine.config.EngineConfig`, opaque here apart from the two fields it reads.

Two ways to launch:

* **Spawned** (``LLM(model, tensor_parallel_size=N)`` in a process without torch.distributed):
  the calling process becomes rank 0 and starts ranks ``1..N-1`` with the ``spawn`` start
  method; they meet through a file store in a fresh temporary directory. Rank ``r`` runs on
  ``cuda:r`` under NCCL, or on the CPU under gloo.
* **One script on every rank** (``torchrun --nproc-per-node N script.py``): the script
  initializes the default process group itself (``world_size`` must equal
  ``tensor_parallel_size``), and every rank constructs the same ``LLM`` and calls the same
  ``generate``; rank 0 schedules and returns the outputs, the other ranks run its steps and return
  ``[]`` when it finishes. Every rank calls ``shutdown()`` at the end.

Invariants: every rank builds its runner with the same arguments, in the same order of collectives
(the agreed block count, CUDA-graph captures); only rank 0 has a block manager and a scheduler; a
rank that is not 0 leaves :meth:`~pagedkv.engine.model_runner.ModelRunner.serve` only on STOP
(or, in the one-script launch, END); rank 0's shutdown is idempotent and also runs at interpreter
exit, so spawned ranks never outlive it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import InvalidConfigError
from .step_broadcast import CMD_END, CMD_STOP
from .tp import TPGroup, head_split, init_group, model_heads

__all__ = ["WorkerSpec", "TPSession", "start_tp", "build_worker", "dist_rank", "backend_for",
           "serve_until_end"]


def backend_for(device_type: str) -> str:
    """``"nccl"`` for CUDA, ``"gloo"`` for the CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


@dataclass
class WorkerSpec:
    """What a rank needs to build rank 0's runner for its own shard (picklable)."""

    #: Where the rank loads the model from (``None``: the builder's default model).
    model: Optional[str]
    device_type: str
    dtype: Any
    #: The engine's settings (an :class:`pagedkv.engine.config.EngineConfig`), rank 0's own.
    config: Any
    #: ``build(spec, group, loaded)``: loads the model unless ``loaded`` is given (on the group's
    #: device under NCCL, else on :attr:`device` or the CPU), shards it, returns the rank's runner
    #: with its host pool.
    build: "RunnerBuilder"
    device: Any = None
    init_method: str = ""

    @property
    def world_size(self) -> int:
        return int(self.config.tensor_parallel_size)

    @property
    def timeout_s(self) -> float:
        return float(self.config.tp_timeout_s)


RunnerBuilder = Callable[[WorkerSpec, TPGroup, Any], Any]


def _worker_main(rank: int, spec: WorkerSpec) -> None:
    """A spawned rank: join the group, build the runner, run rank 0's steps until STOP."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    group = init_group(backend_for(spec.device_type), spec.init_method, rank, spec.world_size,
                       timeout_s=spec.timeout_s)
    try:
        runner = spec.build(spec, group, None)
        runner.serve()
        group.gather_objects(runner.step_records)
    finally:
        dist.destroy_process_group()


class TPSession:
    """Rank 0's side of a tensor-parallel group: the group, the spawned ranks, the shutdown.

    Create with :meth:`spawn` (rank 0 starts the other ranks) or :meth:`attach` (the process group
    exists already: one script on every rank).
    """

    def __init__(self, group: TPGroup, processes: list, owns_group: bool,
                 store_dir: Optional[str]) -> None:
        self.group = group
        self.processes = processes
        self.owns_group = owns_group
        self._store_dir = store_dir
        self.runner: Any = None
        #: After :meth:`close` with ``record_steps``: every rank's step records, in rank order.
        self.step_records: Optional[list] = None
        self.closed = False
        atexit.register(self.close)

    @classmethod
    def spawn(cls, spec: WorkerSpec) -> "TPSession":
        """Starts ranks ``1..world_size-1`` running :func:`_worker_main`, joins as rank 0."""
        store_dir = tempfile.mkdtemp(prefix="pagedkv-tp-")
        spec.init_method = "file://" + os.path.join(store_dir, "store")
        ctx = mp.get_context("spawn")
        procs = []
        try:
            for rank in range(1, spec.world_size):
                p = ctx.Process(target=_worker_main, args=(rank, spec), daemon=True,
                                name=f"pagedkv-tp-rank{rank}")
                p.start()
                procs.append(p)
            group = init_group(backend_for(spec.device_type), spec.init_method, 0,
                               spec.world_size, timeout_s=spec.timeout_s)
        except BaseException:
            for p in procs:
                p.terminate()
                p.join(5)
            shutil.rmtree(store_dir, ignore_errors=True)
            raise
        return cls(group, procs, owns_group=True, store_dir=store_dir)

    @classmethod
    def attach(cls, world_size: int) -> "TPSession":
        """Uses the initialized default process group (its rank must be 0 here)."""
        group = TPGroup()
        if group.world_size != world_size:
            raise InvalidConfigError(
                f"tensor_parallel_size {world_size} but the process group has "
                f"{group.world_size} ranks", field="tensor_parallel_size", value=world_size,
                reason="must equal the process group's size")
        return cls(group, [], owns_group=False, store_dir=None)

    def end_generate(self) -> None:
        """Tells ranks launched with one script that ``generate`` finished (spawned ranks ignore
        it)."""
        if not self.owns_group and not self.closed and self.runner is not None:
            self.runner.broadcaster.send_command(CMD_END)

    def close(self) -> None:
        """Sends STOP, collects the step records, stops the spawned ranks. Idempotent."""
        if self.closed:
            return
        if self.runner is None:
            self.abort()
            return
        self.closed = True
        atexit.unregister(self.close)

        try:
            if self.runner is not None and self.runner.broadcaster is not None:
                self.runner.broadcaster.send_command(CMD_STOP)
                self.step_records = self.group.gather_objects(self.runner.step_records)
        finally:
            if self.owns_group:
                for p in self.processes:
                    p.join(60)
                    if p.is_alive():
                        p.terminate()
                        p.join(5)
                if dist.is_initialized():
                    dist.destroy_process_group()
                if self._store_dir:
                    shutil.rmtree(self._store_dir, ignore_errors=True)

    def abort(self) -> None:
        """After a failure on rank 0 before the runner exists: stop the spawned ranks by handle."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)

        for p in self.processes:
            p.terminate()
            p.join(5)
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        if self._store_dir:
            shutil.rmtree(self._store_dir, ignore_errors=True)


def serve_until_end(runner: Any) -> int:
    """One-script launch, a rank other than 0: runs steps until END or STOP; returns which."""
    return runner.serve(until=(CMD_END,))


def dist_rank() -> int:
    """This process's rank in an initialized torch.distributed group; 0 without one."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def start_tp(loaded: Any, *, preloaded: bool, path: str, config: Any,
             build: RunnerBuilder) -> "TPSession":
    """Rank 0: checks the head split, then joins the existing process group or spawns the ranks.

    ``loaded`` is rank 0's model (its ``config``, ``device`` and ``dtype`` are read), ``preloaded``
    whether the caller passed it already loaded (spawned ranks then could not load the same),
    ``path`` where the spawned ranks load it from, ``build`` what they build their runner with.
    """
    tp_size = config.tensor_parallel_size
    hq, hkv, _ = model_heads(loaded.config)
    head_split(hq, hkv, tp_size, 0)  # a typed error before any process starts
    if dist.is_available() and dist.is_initialized():
        session = TPSession.attach(tp_size)
        if session.group.rank != 0:
            raise InvalidConfigError(
                f"LLMEngine schedules on rank 0; rank {session.group.rank} constructs LLM (which "
                f"runs rank 0's steps) instead", field="tensor_parallel_size", value=tp_size,
                reason="engine on rank 0 only")
        return session
    dev = loaded.device
    if preloaded:
        raise InvalidConfigError(
            "spawned tensor-parallel ranks load the model themselves: pass its path, or launch "
            "every rank yourself (torchrun) and pass each its LoadedModel",
            field="tensor_parallel_size", value=tp_size, reason="preloaded model")
    if dev.type == "cuda" and (dev.index or 0) != 0:
        raise InvalidConfigError(
            f"spawned ranks use cuda:0..cuda:{tp_size - 1}; rank 0 must be on cuda:0, not {dev}",
            field="tensor_parallel_size", value=tp_size, reason="rank 0 on cuda:0")
    if dev.type == "cuda" and torch.cuda.device_count() < tp_size:
        raise InvalidConfigError(
            f"tensor_parallel_size {tp_size} needs {tp_size} GPUs, "
            f"{torch.cuda.device_count()} visible", field="tensor_parallel_size",
            value=tp_size, reason="not enough GPUs")
    spec = WorkerSpec(model=path, device_type=dev.type,
                      dtype=str(loaded.dtype).rpartition(".")[2], config=config, build=build)
    return TPSession.spawn(spec)


def build_worker(model: Any, *, device: Any, dtype: Any, config: Any,
                 build: RunnerBuilder) -> Any:
    """A rank other than 0 of a group the caller made: its model shard and runner.

    ``model`` is a path (``None``: the builder's default model) or an already loaded model.
    """
    tp = config.tensor_parallel_size
    group = TPGroup()
    if group.world_size != tp:
        raise InvalidConfigError(
            f"tensor_parallel_size {tp} but the process group has {group.world_size} ranks",
            field="tensor_parallel_size", value=tp, reason="must equal the process group's size")
    is_path = model is None or isinstance(model, (str, os.PathLike))
    loaded = None if is_path else model
    spec = WorkerSpec(model=(None if model is None else str(model)) if is_path
                      else str(loaded.path),
                      device_type=group.device.type if is_path else loaded.device.type,
                      dtype=dtype if is_path else None, config=config, build=build,
                      device=device)
    return build(spec, group, loaded)
