"""Run jobs in several CPU processes with the gloo backend (forked workers: ~0.2 s each to start).

`run_world(world, jobs)` forks `world` processes; each joins one process group and runs every
job in order, each job building its own device mesh. A job is (config, out_dir, train kwargs).
An exception in any worker fails the call with that worker's traceback. `run_fn(world, fn, *args)`
runs any function fn(rank, world, *args) in the workers instead.
"""

import multiprocessing as mp
import os
import socket
import time
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, jobs, errors):
    try:
        import torch

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
        from pithtrain.parallel.mesh import init_mesh
        from pithtrain.train.loop import train

        for config, out_dir, kwargs in jobs:
            p = config.parallel
            mesh = init_mesh(p.pp, p.cp, p.ep, "cpu", p.timeout_s, p.hsdp)
            train(config, out_dir, echo=False, mesh=mesh, **kwargs)
        torch.distributed.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        os._exit(1)


def run_world(world: int, jobs: list, timeout_s: float = 600) -> None:
    ctx = mp.get_context("fork")
    errors = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, jobs, errors)) for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout_s)
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.kill()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    if alive or messages or any(p.exitcode for p in procs):
        raise AssertionError(f"distributed run failed (hung: {len(alive)}):\n" + "\n".join(messages))


def _fn_worker(rank, world, port, fn, args, errors):
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo")
        fn(rank, world, *args)
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        errors.close()
        errors.join_thread()  # flush the message before the hard exit
        os._exit(1)


def run_fn(world: int, fn, *args, timeout_s: float = 600) -> None:
    """Fork `world` gloo workers, each calling fn(rank, world, *args) in the default process group.
    A failing worker fails the call with its traceback and ends the others at once (they would
    wait on it until the timeout). Forked: fn and args need no pickling."""
    ctx = mp.get_context("fork")
    errors = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_fn_worker, args=(r, world, port, fn, args, errors)) for r in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode for p in procs):
            break
        time.sleep(0.05)
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.kill()
        proc.join()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    if alive or messages or any(p.exitcode for p in procs):
        raise AssertionError(f"distributed run failed (killed: {len(alive)}):\n" + "\n".join(messages))
