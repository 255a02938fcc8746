"""Run functions in several CPU processes with the gloo backend (forked workers: ~0.2 s each to start).

`run_fn(world, fn, *args)` forks `world` workers; each joins one default process group, calls
fn(rank, world, *args) and reports its return value; the call returns those values by rank. An
exception in any worker fails the call with that worker's traceback and ends the others at once.
`run_world(world, jobs)` runs training jobs (config, out_dir, train kwargs) in order in every
worker, each job building its own device mesh.
"""

import multiprocessing as mp
import os
import sys
import threading
import time
import traceback


def _fn_worker(rank, world, ports, fn, args, errors, results, joined):
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        port = ports.get(timeout=60)  # the store starts after the fork (see _run_once)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        joined.put(rank)
        results.put((rank, fn(rank, world, *args)))
        dist.destroy_process_group()
        results.close()
        results.join_thread()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        errors.close()
        errors.join_thread()  # flush the message before the hard exit
        os._exit(1)


def _stop_stray_threads() -> None:
    """A forked worker inherits every lock that another thread of this process holds at the fork, and
    can hang on one: stop the threads earlier tests leave running here. tqdm's monitor (started by
    transformers' and datasets' progress bars) is one; two gloo tests hung on 2026-12-02 with it alive."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is not None:
        tqdm.tqdm.monitor_interval = 0  # no new monitor
        if tqdm.tqdm.monitor is not None:
            tqdm.tqdm.monitor.exit()
            tqdm.tqdm.monitor = None
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if others:  # not fatal, but the first thing to look at if a forked run hangs
        print(f"dist_util: threads alive at the fork: {others}", file=sys.stderr)


def run_fn(world: int, fn, *args, timeout_s: float = 600, join_s: float = 45) -> list:
    """fn(rank, world, *args) on `world` forked gloo workers; returns their results by rank.
    Forked: fn and args need no pickling (results do). Workers that have not all joined the process
    group after `join_s` (nothing run yet: gloo's connection setup stalled, seen with 4 and 8 workers
    on a loaded 2-core machine) are killed and started once more. A normal join takes 0.1-0.2 s
    (4 and 8 workers, an idle 2-core machine, 2026-12-02): 45 s is a wide margin, and a stall costs
    45 s, not the run's whole timeout."""
    for attempt in range(2):
        out = _run_once(world, fn, args, timeout_s, join_s)
        if out is not None:
            return out
        print(f"dist_util: {world} workers had not joined the process group after {join_s:.0f} s; started again",
              file=sys.stderr)
    raise AssertionError(f"distributed run failed: {world} workers did not join the process group, twice")


def _run_once(world, fn, args, timeout_s, join_s) -> list | None:
    from torch.distributed import TCPStore

    _stop_stray_threads()
    # imported once here, not in every worker: building a model on the meta device imports torch._dynamo
    # (torch._refs' wrappers), 1.2 s alone and 7 s in each of 8 workers started together on 2 cores
    import torch._dynamo  # noqa: F401

    ctx = mp.get_context("fork")
    errors, results, joined, ports = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_fn_worker, args=(r, world, ports, fn, args, errors, results, joined)) for r in range(world)]
    for proc in procs:
        proc.start()
    # the rendezvous store lives here, on a port the OS picked (no free-port race between concurrent runs),
    # and starts only after the fork: its server thread, forked while it held a lock, could hang a worker
    store = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    for _ in range(world):
        ports.put(store.port)
    ports.close()
    ports.join_thread()  # its feeder thread ends here, not alive at the next fork
    start = time.monotonic()
    deadline = start + timeout_s
    done, ready = {}, set()
    while len(done) < world and time.monotonic() < deadline and not any(p.exitcode for p in procs):
        while not joined.empty():
            ready.add(joined.get())
        if len(ready) < world and time.monotonic() - start > join_s and errors.empty():
            for proc in procs:
                proc.kill()
                proc.join()
            return None
        while not results.empty():
            rank, value = results.get()
            done[rank] = value
        time.sleep(0.05)
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.kill()
        proc.join()
    while not results.empty():
        rank, value = results.get()
        done[rank] = value
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    if alive or messages or any(p.exitcode for p in procs) or len(done) < world:
        raise AssertionError(f"distributed run failed (killed: {len(alive)}):\n" + "\n".join(messages))
    return [done[r] for r in range(world)]


def _train_jobs(rank, world, jobs) -> int:
    from pithtrain.parallel.mesh import init_mesh
    from pithtrain.train.loop import train

    for config, out_dir, kwargs in jobs:
        p = config.parallel
        mesh = init_mesh(p.pp, p.cp, p.ep, "cpu", p.timeout_s, p.hsdp)
        train(config, out_dir, echo=False, mesh=mesh, **kwargs)
    return len(jobs)


def run_world(world: int, jobs: list, timeout_s: float = 600) -> None:
    """Every training job on every one of `world` workers."""
    finished = run_fn(world, _train_jobs, jobs, timeout_s=timeout_s)
    assert finished == [len(jobs)] * world, finished
