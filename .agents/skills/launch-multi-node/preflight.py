"""Preflight for a multi-process / multi-node PithTrain launch; ends with PASS or FAIL: <reason>.

Run it with the launcher and the arguments of the training job (it takes `pithtrain train`'s):
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \
      .agents/skills/launch-multi-node/preflight.py CONFIG --pp 2 --ep 8 --out runs/big
or on one machine, where it starts N workers itself (gloo on the CPU, NCCL on GPUs):
  .venv/bin/python .agents/skills/launch-multi-node/preflight.py examples/qwen3_tiny.py --nproc 4 --ep 2 \
      --set train.micro_batch_size=4

Before any process group: load the config, apply --set/--steps/--pp/--cp/--ep/--hsdp as
`pithtrain train` does, `validate` it for the world size, print the mesh and its EP groups.
Then, in the mesh's process groups, with fresh random integers (exact checks): an all_reduce
over the world, an all_to_all_single in every EP group, a send/recv with each pipeline
neighbour when pp > 1; that every rank loaded the same config; with --out, that every rank sees
the files of all others there (checkpoints need one shared directory). It never reads the data:
it FAILs when data.path is a directory on no host, and notes the hosts where it is missing.
Rank 0 prints hosts, devices and timings; exit code 0 (PASS) or 1 (FAIL).
"""

import contextlib
import hashlib
import logging
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

_CHILD = "PITHTRAIN_PREFLIGHT_CHILD"  # set for workers started by --nproc: a FAIL verdict exits 3
if os.environ.get(_CHILD):  # a worker of --nproc: Ctrl-C ends it quietly, even while it
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))  # imports torch; its launcher prints the FAIL line
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, when not installed

import torch

from pithtrain.cli import build_parser, train_config
from pithtrain.config import ConfigError, UserError, data_parts, validate
from pithtrain.train.rundir import check_out, check_unheld

NUMEL, ITERS = 4096, 3  # int64 elements per block; checked iterations per collective (the first sets up links)


def plan(config, world: int) -> str:
    """The (pp, dp, cp, ep) mesh of init_mesh, outer to inner: EP groups are runs of ep consecutive ranks."""
    p, t = config.parallel, config.train
    dp = world // (p.pp * p.cp * p.ep)
    groups = [list(range(s, s + p.ep)) for s in range(0, world, p.ep)]
    shown = " ".join(str(g) for g in groups[:8]) + (f" ... ({len(groups)} groups)" if len(groups) > 8 else "")
    stride = dp * p.cp * p.ep
    micro = t.global_batch_size // (t.micro_batch_size * dp * p.ep)
    return (f"mesh: pp={p.pp} dp={dp} cp={p.cp} ep={p.ep} (world {world}{', hsdp' if p.hsdp else ''})\n"
            f"EP groups: {shown}\n"
            f"pipeline stages of rank 0: {list(range(0, world, stride))}\n"
            f"batch: {t.global_batch_size} = micro {t.micro_batch_size} x data ranks {dp * p.ep} x {micro} micro-batches")


def pick_device(name: str) -> torch.device:
    """As pithtrain.train.loop.pick_device (importing the loop costs seconds in every process)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


def block(seed: int, *key: int) -> torch.Tensor:
    """NUMEL random int64s determined by (seed, key): every rank can recompute what any rank sent."""
    s = seed
    for k in key:
        s = (s * 1_000_003 + k + 1) % 2**63
    return torch.randint(-2**20, 2**20, (NUMEL,), generator=torch.Generator().manual_seed(s))


def checks(config, args, device) -> int:
    import torch.distributed as dist

    from pithtrain.parallel.mesh import init_mesh

    p, rank, world, host = config.parallel, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), socket.gethostname()
    start = time.perf_counter()
    mesh = init_mesh(p.pp, p.cp, p.ep, device.type, p.timeout_s, p.hsdp)
    dev = mesh.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    errors, times = [], {"init_mesh": [time.perf_counter() - start]}

    def timed(name, fn):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.setdefault(name, []).append(time.perf_counter() - t)

    seed = [secrets.randbits(40)]
    dist.broadcast_object_list(seed, src=0)
    seed = seed[0]
    ep_ranks = dist.get_process_group_ranks(mesh.ep_group) if p.ep > 1 else [rank]
    if ep_ranks != list(range(rank - mesh.ep_rank, rank - mesh.ep_rank + p.ep)):
        errors.append(f"EP group {ep_ranks} is not the planned consecutive ranks")
    pp_group = mesh.device_mesh["pp"].get_group() if p.pp > 1 else None
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp_group else [rank]
    neighbours = [pp_ranks[mesh.pp_rank + d] for d in (-1, 1) if 0 <= mesh.pp_rank + d < p.pp]
    for it in range(ITERS):
        x = block(seed, 0, it, rank).to(dev)
        timed("all_reduce (world)", lambda: dist.all_reduce(x))
        expected = sum(block(seed, 0, it, r) for r in range(world))
        if not torch.equal(x.cpu(), expected):
            errors.append(f"all_reduce: {int((x.cpu() != expected).sum())} of {NUMEL} sums wrong (iteration {it})")
        if p.ep > 1:
            send = torch.cat([block(seed, 1, it, rank, dst) for dst in ep_ranks]).to(dev)
            recv = torch.empty_like(send)
            timed("all_to_all_single (EP)", lambda: dist.all_to_all_single(recv, send, group=mesh.ep_group))
            got = recv.cpu().view(p.ep, NUMEL)
            bad = [src for i, src in enumerate(ep_ranks) if not torch.equal(got[i], block(seed, 1, it, src, rank))]
            if bad:
                errors.append(f"all_to_all_single: wrong block from ranks {bad} (iteration {it})")
        if neighbours:
            recv = {q: torch.empty(NUMEL, dtype=torch.int64, device=dev) for q in neighbours}
            ops = [dist.P2POp(dist.isend, block(seed, 2, it, rank, q).to(dev), q, pp_group) for q in neighbours]
            ops += [dist.P2POp(dist.irecv, recv[q], q, pp_group) for q in neighbours]
            timed("send/recv (pp neighbours)", lambda: [w.wait() for w in dist.batch_isend_irecv(ops)])
            bad = [q for q in neighbours if not torch.equal(recv[q].cpu(), block(seed, 2, it, q, rank))]
            if bad:
                errors.append(f"send/recv: wrong data from pipeline neighbours {bad} (iteration {it})")
    shared = Path(args.out) / ".preflight" / f"{seed:x}" if args.out else None
    if shared:
        fresh = not Path(args.out).exists()  # seen by every rank before any creates it: removed again at the end
        dist.barrier()
        shared.mkdir(parents=True, exist_ok=True)
        (shared / f"rank{rank}").write_text(host)
        dist.barrier()
        missing = [r for r in range(world) if not (shared / f"rank{r}").is_file()]
        if missing:
            errors.append(f"--out {args.out} is not shared: this rank does not see ranks {missing[:8]}'s files; "
                          f"checkpoints need one directory that every node mounts")
    info = dict(rank=rank, host=host, device=str(dev), torch=torch.__version__, errors=errors, times=times,
                data=all(Path(path).is_dir() for path, _ in data_parts(config.data.path)),
                config=hashlib.sha1(repr(config).encode()).hexdigest()[:10])
    infos = [None] * world
    dist.all_gather_object(infos, info)
    problems = [f"rank {i['rank']} ({i['host']}): {e}" for i in infos for e in i["errors"]]
    kinds = {}  # config hash / torch version -> ranks
    for i in infos:
        kinds.setdefault(f"{i['config']}/{i['torch']}", []).append(i["rank"])
    if len(kinds) > 1:
        found = "; ".join(f"{k} on ranks {v[:8]}" for k, v in kinds.items())
        problems.append(f"ranks differ in config/torch version ({found}): "
                        "give every node the same checkout, environment and arguments")
    hosts, no_data = {i["host"] for i in infos}, sorted({i["host"] for i in infos if not i["data"]})
    if len(no_data) == len(hosts):  # the preflight never reads the data; every rank of the job does
        problems.append(f"data.path {config.data.path!r} is not a directory on any host ({', '.join(no_data)}): "
                        f"make the dataset there (setup-benchmark-inputs) or --set data.path=DIR")
    if rank == 0:
        print(f"backend {dist.get_backend()}, {world} ranks on {len(hosts)} host(s)")
        for i in infos:
            print(f"  rank {i['rank']:4d}  {i['host']}  {i['device']}  torch {i['torch']}  config {i['config']}")
        for s in range(0, world, p.ep):  # a note, not a failure: the all-to-all then crosses the network
            spans = sorted({infos[r]["host"] for r in range(s, s + p.ep)})
            if len(spans) > 1:
                print(f"note: EP group {list(range(s, s + p.ep))} spans hosts {spans}: choose ep <= GPUs per node")
        if no_data and len(no_data) < len(hosts):
            print(f"note: data.path {config.data.path!r} is not a directory on {no_data}: every node needs the dataset")
        print("timings, slowest rank (first call, which sets up connections / best of the rest):")
        for name in infos[0]["times"]:
            per_call = [max(i["times"][name][k] for i in infos) for k in range(len(infos[0]["times"][name]))]
            rest = f" / {min(per_call[1:]) * 1e3:8.2f} ms" if len(per_call) > 1 else ""
            print(f"  {name:28s} {per_call[0] * 1e3:8.2f} ms{rest}")
        for line in problems if len(problems) > 1 else []:  # a single one is the FAIL line
            print(f"problem: {line}")
        more = f" (+{len(problems) - 1} more above)" if len(problems) > 1 else ""
        checked = ", ".join(["all_reduce"] + ["all_to_all (EP)"] * (p.ep > 1) + ["send/recv (PP)"] * (p.pp > 1))
        print(f"FAIL: {problems[0]}{more}" if problems else f"PASS: {world} rank(s) on {len(hosts)} host(s): {checked} exact, "
              f"one config and torch version, data.path found" + (f", --out {args.out} shared" if args.out else ""), flush=True)
    dist.barrier()
    if shared:
        (shared / f"rank{rank}").unlink()
        dist.barrier()
        for d in (shared, shared.parent, *([Path(args.out)] if fresh else [])) if os.environ.get("LOCAL_RANK") == "0" else ():
            with contextlib.suppress(OSError):  # empty now; another node may have removed it already
                d.rmdir()
    dist.destroy_process_group()
    return 0 if not problems else (3 if os.environ.get(_CHILD) else 1)


def resumable(config, out: Path) -> None:
    """What `pithtrain train` refuses at its start in a run directory whose newest checkpoint is of another model,
    data order, batch or optimizer (loop.check_resume; raises UserError). Its data.path is left to the run,
    which reads the datasets (a moved one is taken), as this script reads no data."""
    metas = sorted(m for m in out.glob("checkpoints/step_*/meta.json") if m.parent.name[5:].isdigit())
    if not metas:
        return
    import dataclasses
    import json

    from pithtrain.train.loop import check_resume  # seconds to import: only where there is a run to resume

    try:
        meta = json.loads(metas[-1].read_text())
        path = meta.get("data_path") or meta["config"]["data"]["path"]
    except (OSError, ValueError, LookupError, TypeError):  # the run checks, and sets aside, a damaged one
        return
    check_resume(dataclasses.replace(config, data=dataclasses.replace(config.data, path=path)), metas[-1].parent, echo=False)


def launch_local(nproc: int, argv: list) -> int:
    """--nproc workers with PyTorch's elastic launcher (its failure summary carries the exit codes of the checks)."""
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ[_CHILD] = "1"
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its failure line would follow our verdict
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5)
    try:
        elastic_launch(launch, sys.executable)(os.path.abspath(__file__), *argv)
    except ChildFailedError as e:
        codes = {f.local_rank: f.exitcode for f in e.failures.values()}
        if 3 in codes.values() and all(c == 3 or c < 0 for c in codes.values()):
            return 1  # the checks ran and rank 0 printed the FAIL line (the launcher may stop the others first)
        print(e.format_msg(), file=sys.stderr)
        print(f"FAIL: worker processes exited with errors (rank: exit code {codes}); see their output above")
        return 1
    except (KeyboardInterrupt, SignalException):  # Ctrl-C or a signal: the workers stop too
        print("FAIL: interrupted (Ctrl-C or a signal) before the checks ended; no verdict")
        return 130
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(["train", *argv])
    except UserError as e:  # argparse's: an unknown flag, a missing CONFIG
        print(f"FAIL: {str(e).replace('pithtrain:', 'preflight (it takes `pithtrain train` arguments):', 1)}")
        return 2
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ["WORLD_SIZE"]) if launched else args.nproc
    try:
        config = train_config(args)  # exactly as `pithtrain train` builds it from these arguments
        validate(config, world_size=world)  # raises ConfigError naming the field and the fix
        if config.parallel.pp > 1:  # refused by `pithtrain train` at its start too (loop.check_run)
            from pithtrain.train.loop import check_pipeline_layers

            check_pipeline_layers(config)
        existing = next((p for p in (Path(args.out), *Path(args.out).parents) if p.exists()), None) if args.out else None
        if existing is not None and not existing.is_dir():
            raise ConfigError(f"--out {args.out}: {existing} is a file, not a directory; choose a directory that every node mounts")
        if args.out:  # what `pithtrain train` refuses there (a directory of other files, one a live run holds)
            check_out(Path(args.out))
            if rank == 0:  # one prober of the lock: ranks flocking it at once would see each other as its holder
                check_unheld(Path(args.out))
                resumable(config, Path(args.out))
        device = pick_device(config.train.device)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if launched else args.nproc
        if device.type == "cuda" and local > torch.cuda.device_count():
            raise ConfigError(f"{local} processes on {socket.gethostname()} but {torch.cuda.device_count()} GPUs "
                              f"visible: use --nproc-per-node (or --nproc) <= the GPU count, or --set train.device=cpu")
    except (ValueError, RuntimeError) as e:  # ConfigError, and rundir's refusals
        if rank == 0:
            print(f"FAIL: {e}")
        elif os.environ.get("LOCAL_RANK") == "0":  # one line per other node
            print(f"rank {rank} ({socket.gethostname()}): FAIL: {e}", file=sys.stderr)
        return 1
    if not launched:
        return launch_local(args.nproc, argv)
    try:
        if rank == 0:
            print(plan(config, world), flush=True)
        return checks(config, args, device)
    except KeyboardInterrupt:  # Ctrl-C reaches every worker: no traceback; rank 0 of a torchrun job says it
        if rank == 0 and not os.environ.get(_CHILD):
            print("FAIL: interrupted (Ctrl-C) before the checks ended; no verdict")
        return 130


if __name__ == "__main__":
    sys.exit(main())
