"""Starting and stopping the ranks of a tensor-parallel engine.

Owns :class:`WorkerSpec` (everything a rank needs to build the same runner as rank 0),
:func:`build_runner` (load, shard, runner, host pool: identical on every rank), :class:`TPSession`
(rank 0's handle on the group: the processes it spawned, STOP at shutdown, the step records) and
the spawned ranks' entry point.

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
from typing import Any, Optional

from .step_broadcast import CMD_END, CMD_STOP
from .tp import TPGroup, init_group

__all__ = ["WorkerSpec", "TPSession", "build_runner", "backend_for"]


def backend_for(device_type: str) -> str:
    """``"nccl"`` for CUDA, ``"gloo"`` for the CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


@dataclass
class WorkerSpec:
    """What a rank needs to build rank 0's runner for its own shard (picklable)."""

    model: str
    device_type: str
    dtype: Optional[str]
    #: The engine's settings (an :class:`pagedkv.engine.config.EngineConfig`), rank 0's own.
    config: Any
    init_method: str = ""

    @property
    def world_size(self) -> int:
        return int(self.config.tensor_parallel_size)

    @property
    def timeout_s(self) -> float:
        return float(self.config.tp_timeout_s)


def build_runner(spec: WorkerSpec, group: TPGroup, loaded: Any = None) -> Any:
    """Loads (unless given) and shards the model, builds the runner and its host pool."""
    from ..engine.loader import load_model
    from ..engine.model_runner import ModelRunner

    if loaded is None:
        device = group.device if spec.device_type == "cuda" else "cpu"
        loaded = load_model(spec.model, device=device, dtype=spec.dtype)
    runner = ModelRunner(loaded, spec.config, tensor_parallel=group)
    blocks = spec.config.host_blocks(runner.spec.bytes_per_block)
    if blocks:
        runner.enable_swap(blocks)
    return runner


def _worker_main(rank: int, spec: WorkerSpec) -> None:
    """A spawned rank: join the group, build the runner, run rank 0's steps until STOP."""
    import torch.distributed as dist

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    group = init_group(backend_for(spec.device_type), spec.init_method, rank, spec.world_size,
                       timeout_s=spec.timeout_s)
    try:
        runner = build_runner(spec, group)
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
        import torch.multiprocessing as mp

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
        from ..errors import InvalidConfigError

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
        import torch.distributed as dist

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
        import torch.distributed as dist

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
