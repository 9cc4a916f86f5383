"""The main function of a tensor-parallel rank process (ranks 1..tp-1; rank 0 is the engine's).

A rank builds its part of the model and its KV cache, then loops: receive a ``StepPlan`` from
rank 0 through its pipe, run it (the all-reduces and the logits gather meet rank 0's), repeat.
It exits when rank 0 sends ``None`` (close), when the pipe reaches EOF or its parent process
is gone (rank 0 died), and after any error, which it reports through the pipe first.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import threading
import time
import traceback

PARENT_POLL_S = 0.5  # seconds between checks that the parent (rank 0) is alive
# Test hook: "RANK:STEP" makes that rank raise in its STEP-th step (1-based; 0: while building its
# model), so the tests can check how an error in a rank is reported and cleaned up.
FAULT_ENV = "TESSERA_TEST_TP_FAIL_AT"


def _exit_when_parent_dies(parent_pid: int) -> None:
    """Rank 0 killed (SIGKILL, OOM killer) leaves no EOF while this rank waits in a collective, and
    NCCL would wait for its timeout: watch the parent and leave at once when it is gone."""
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(PARENT_POLL_S)
    threading.Thread(target=watch, name="tessera-tp-parent-watch", daemon=True).start()


def _fault_step(rank: int) -> int | None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    fault_rank, _, step = spec.partition(":")
    return int(step) if int(fault_rank) == rank else None


def rank_main(config, rank: int, world_size: int, port: int, conn, num_kv_blocks: int | None,
              num_threads: int, parent_pid: int) -> None:
    """Run rank ``rank`` until rank 0 closes it (see the module docstring).

    Args:
        config: the engine's ``EngineConfig`` (its device becomes ``cuda:<rank>`` on GPUs).
        port: rank 0's rendezvous store on 127.0.0.1.
        conn: this rank's end of its pipe to rank 0: receives pickled ``StepPlan`` bytes (``b""`` to
            stop) and sends ``("started", None)`` before joining the group, ``("ready", None)`` once
            built, ``("error", traceback text)`` on failure.
        num_threads: torch CPU threads of this rank (the cores divided among the ranks).
    """
    _exit_when_parent_dies(parent_pid)
    import torch  # noqa: PLC0415 (after the watch: importing torch takes seconds)

    from ..runner.model_runner import ModelRunner  # noqa: PLC0415
    from .process_group import join_group  # noqa: PLC0415

    torch.set_num_threads(num_threads)
    if config.device.startswith("cuda"):
        torch.cuda.set_device(rank)
        config = dataclasses.replace(config, device=f"cuda:{rank}")
    fail_at = _fault_step(rank)
    try:
        conn.send(("started", None))  # rank 0 joins the group only once every rank can
        group = join_group(rank, world_size, config.device, port=port)
        if fail_at == 0:
            raise RuntimeError(f"injected fault ({FAULT_ENV}) while building the model")
        runner = ModelRunner(config, num_kv_blocks, tp=group)
        conn.send(("ready", None))
        step = 0
        while True:
            payload = conn.recv_bytes()
            if not payload:
                runner.release_graphs()
                group.shutdown()  # with rank 0's (see TensorParallelGroup.shutdown)
                break
            step += 1
            if step == fail_at:
                raise RuntimeError(f"injected fault ({FAULT_ENV}) in step {step}")
            runner.run(pickle.loads(payload))
    except EOFError:  # rank 0 is gone
        os._exit(3)
    except BaseException:  # noqa: BLE001 (reported to rank 0, which raises it)
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)  # at once: the peers' collectives fail as this rank's sockets close
    os._exit(0)
