"""Rank script: every supported het_shim operation equals the flat gloo collective on the same ranks.

Runs several vendor layouts in one job (the vendor map is read when a group is created): 3+1, 2+2
interleaved, four one-member subgroups, one vendor (the native fast path), and a 3-rank subgroup of
the world (global -> group rank mapping). Reports the number of comparisons and every mismatch.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from integration_tests.support.launch import arm_watchdog, report  # noqa: E402

arm_watchdog()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import het_plugin.comm as comm  # noqa: E402

R = dist.ReduceOp
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INTS = (torch.int64, torch.int32, torch.uint8)
LAYOUTS = {
    "3+1": ["nvidia", "nvidia", "nvidia", "amd"],
    "2+2-interleaved": ["nvidia", "amd", "amd", "nvidia"],
    "1+1+1+1": ["nvidia", "amd", "intel", "other"],
    "single-vendor": ["nvidia"] * 4,
}


class Checker:
    def __init__(self):
        self.checks = 0
        self.failures = []

    def same(self, name, got, want):
        self.checks += 1
        if got.dtype != want.dtype or got.shape != want.shape:
            self.failures.append(f"{name}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}")
            return
        if got.is_floating_point():
            tol = 1e-5 if got.dtype == torch.float32 else 3e-2
            ok = torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
        else:
            ok = torch.equal(got, want)
        if not ok:
            self.failures.append(f"{name}: max diff {(got.double() - want.double()).abs().max().item()}")


def sample(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in FLOATS:
        return torch.randn(shape, generator=g).to(dtype)
    hi = 4 if dtype == torch.uint8 else 1000   # uint8: sums of 4 ranks stay < 256
    return torch.randint(0, hi, shape, generator=g).to(dtype)


def run_layout(name, shim, flat, ck: Checker):
    me, n = shim.rank(), shim.size()
    seed = 1000 * dist.get_rank()
    shape = (37, 41)                       # 1517 elements: several chunks at HET_PLUGIN_SHIM_CHUNK_BYTES=1024
    # all_reduce: every dtype, the ops that make sense for it
    for dtype in FLOATS + INTS + (torch.bool,):
        ops = [R.SUM, R.MAX, R.MIN] if dtype != torch.bool else [R.MAX, R.MIN]
        for op in ops:
            x = sample(dtype, shape, seed + 1)
            a, b = x.clone(), x.clone()
            dist.all_reduce(a, op=op, group=shim)
            dist.all_reduce(b, op=op, group=flat)
            ck.same(f"{name} all_reduce {op} {dtype}", a, b)
        if dtype in FLOATS:
            x = sample(dtype, shape, seed + 2)
            a, b = x.clone(), x.clone()
            dist.all_reduce(a, op=R.AVG, group=shim)
            dist.all_reduce(b, op=R.SUM, group=flat)
            ck.same(f"{name} all_reduce AVG {dtype}", a, (b.float() / n).to(dtype))
    x = sample(torch.int32, (5,), seed + 3) % 3 + 1
    a, b = x.clone(), x.clone()
    dist.all_reduce(a, op=R.PRODUCT, group=shim)
    dist.all_reduce(b, op=R.PRODUCT, group=flat)
    ck.same(f"{name} all_reduce PRODUCT int32", a, b)
    # non-contiguous input (a transposed view, and every other column)
    base = sample(torch.float32, (41, 37), seed + 4)
    a, b = base.clone(), base.clone()
    dist.all_reduce(a.t(), group=shim)
    dist.all_reduce(b.t(), group=flat)
    ck.same(f"{name} all_reduce transposed", a, b)
    # (gloo itself treats a strided view as dense memory, so the reference goes through a contiguous copy)
    a, b = base.clone(), base.clone()
    dist.all_reduce(a[:, ::2], group=shim)
    ref = b[:, ::2].contiguous()
    dist.all_reduce(ref, group=flat)
    b[:, ::2] = ref
    ck.same(f"{name} all_reduce strided", a, b)
    # broadcast from every root
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
        for root in range(n):
            x = sample(dtype, shape, seed + 5 + root)
            a, b = x.clone(), x.clone()
            dist.broadcast(a, group_src=root, group=shim)
            dist.broadcast(b, group_src=root, group=flat)
            ck.same(f"{name} broadcast root {root} {dtype}", a, b)
    a, b = base.clone(), base.clone()
    dist.broadcast(a[:, 1::3], group_src=n - 1, group=shim)
    ref = b[:, 1::3].contiguous()
    dist.broadcast(ref, group_src=n - 1, group=flat)
    b[:, 1::3] = ref
    ck.same(f"{name} broadcast strided", a, b)
    # all_gather_into_tensor / all_gather (list) for every dtype
    for dtype in FLOATS + INTS + (torch.bool,):
        x = sample(dtype, (3, 331), seed + 6)
        a = torch.zeros((3 * n, 331), dtype=dtype)
        b = torch.zeros_like(a)
        dist.all_gather_into_tensor(a, x, group=shim)
        dist.all_gather_into_tensor(b, x, group=flat)
        ck.same(f"{name} all_gather_into_tensor {dtype}", a, b)
    x = sample(torch.float32, (7, 6), seed + 7).t()           # non-contiguous input
    la = [torch.zeros(6, 7) for _ in range(n)]
    lb = [torch.zeros(6, 7) for _ in range(n)]
    dist.all_gather(la, x, group=shim)
    dist.all_gather(lb, x, group=flat)
    for i in range(n):
        ck.same(f"{name} all_gather list [{i}]", la[i], lb[i])
    # reduce_scatter_tensor / reduce_scatter (list)
    for dtype in FLOATS + (torch.int64, torch.int32):
        for op in (R.SUM, R.MAX, R.MIN):
            x = sample(dtype, (n * 523,), seed + 8)
            a = torch.zeros(523, dtype=dtype)
            b = torch.zeros_like(a)
            dist.reduce_scatter_tensor(a, x, op=op, group=shim)
            dist.reduce_scatter_tensor(b, x, op=op, group=flat)
            ck.same(f"{name} reduce_scatter_tensor {op} {dtype}", a, b)
    x = sample(torch.float32, (n * 100,), seed + 9)
    a, b = torch.zeros(100), torch.zeros(100)
    dist.reduce_scatter_tensor(a, x, op=R.AVG, group=shim)
    dist.reduce_scatter_tensor(b, x, op=R.SUM, group=flat)
    ck.same(f"{name} reduce_scatter_tensor AVG", a, b / n)
    ins = [sample(torch.int64, (4, 5), seed + 10 + i) for i in range(n)]
    a, b = torch.zeros(4, 5, dtype=torch.int64), torch.zeros(4, 5, dtype=torch.int64)
    dist.reduce_scatter(a, ins, group=shim)
    dist.reduce_scatter(b, ins, group=flat)
    ck.same(f"{name} reduce_scatter list", a, b)
    # many operations in flight (async), waited out of order
    xs = [sample(torch.float32, (257 * (i + 1),), seed + 20 + i) for i in range(6)]
    ys = [x.clone() for x in xs]
    works = [dist.all_reduce(x, group=shim, async_op=True) for x in xs]
    gat = torch.zeros(n * 999, dtype=torch.int64)
    works.append(dist.all_gather_into_tensor(gat, torch.arange(999) + seed, group=shim, async_op=True))
    bc = sample(torch.bfloat16, (1000,), seed + 30)
    bc_ref = bc.clone()
    works.append(dist.broadcast(bc, group_src=n // 2, group=shim, async_op=True))
    for w in reversed(works):
        w.wait()
    for i, y in enumerate(ys):
        dist.all_reduce(y, group=flat)
        ck.same(f"{name} async all_reduce #{i}", xs[i], y)
    gat_ref = torch.zeros_like(gat)
    dist.all_gather_into_tensor(gat_ref, torch.arange(999) + seed, group=flat)
    ck.same(f"{name} async all_gather", gat, gat_ref)
    dist.broadcast(bc_ref, group_src=n // 2, group=flat)
    ck.same(f"{name} async broadcast", bc, bc_ref)
    # coalesced all-gathers, as Megatron's distributed optimizer issues them
    outs = [torch.zeros(n * 64), torch.zeros(n * 16)]
    with dist._coalescing_manager(group=shim, async_ops=True) as cm:
        for o in outs:
            dist.all_gather_into_tensor(o, torch.full((o.numel() // n,), float(seed)), group=shim)
    cm.wait()
    ranks = dist.get_process_group_ranks(shim)
    for o in outs:
        want = torch.tensor([1000.0 * r for r in ranks]).repeat_interleave(o.numel() // n)
        ck.same(f"{name} coalesced all_gather", o, want)
    # object collectives (they ride on broadcast / all_gather) and a work's future
    objs = [{"from": dist.get_rank(), "layout": name}] if me == 0 else [None]
    dist.broadcast_object_list(objs, group_src=0, group=shim)
    ck.same(f"{name} broadcast_object_list", torch.tensor([objs[0]["from"]]), torch.tensor([ranks[0]]))
    gathered = [None] * n
    dist.all_gather_object(gathered, dist.get_rank(), group=shim)
    ck.same(f"{name} all_gather_object", torch.tensor(gathered), torch.tensor(ranks))
    fut = dist.all_reduce(torch.full((3,), float(me)), group=shim, async_op=True).get_future()
    ck.same(f"{name} work.get_future", fut.wait()[0], torch.full((3,), float(sum(range(n)))))
    # barrier
    dist.barrier(group=shim)
    # point to point: ring with send/recv, then batched isend/irecv in both directions (bf16, strided)
    nxt, prv = (me + 1) % n, (me - 1) % n
    x = torch.arange(100, dtype=torch.int64) + 100 * me
    got = torch.zeros(100, dtype=torch.int64)
    if me % 2 == 0:
        dist.send(x, group_dst=nxt, group=shim)
        dist.recv(got, group_src=prv, group=shim)
    else:
        dist.recv(got, group_src=prv, group=shim)
        dist.send(x, group_dst=nxt, group=shim)
    ck.same(f"{name} send/recv ring", got, torch.arange(100, dtype=torch.int64) + 100 * prv)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        fw = (torch.arange(60, dtype=torch.float32).view(6, 10) + me).to(dtype)
        bw = (torch.arange(60, dtype=torch.float32).view(6, 10) - me).to(dtype)
        got_f = torch.zeros(10, 6, dtype=dtype).t()                # non-contiguous receive buffer
        got_b = torch.zeros(6, 10, dtype=dtype)
        ops = [dist.P2POp(dist.isend, fw, ranks[nxt], shim),
               dist.P2POp(dist.irecv, got_f, ranks[prv], shim),
               dist.P2POp(dist.isend, bw, ranks[prv], shim),
               dist.P2POp(dist.irecv, got_b, ranks[nxt], shim)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        ck.same(f"{name} batch_isend_irecv fwd {dtype}", got_f,
                (torch.arange(60, dtype=torch.float32).view(6, 10) + prv).to(dtype))
        ck.same(f"{name} batch_isend_irecv bwd {dtype}", got_b,
                (torch.arange(60, dtype=torch.float32).view(6, 10) - nxt).to(dtype))


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    ck = Checker()
    shapes = {}
    for name, vendors in LAYOUTS.items():
        comm.set_vendor_map(vendors)
        shim = dist.new_group(list(range(world)), backend=comm.SHIM_BACKEND)
        assert isinstance(shim, comm.ShimProcessGroup), type(shim)
        assert dist.get_backend(shim) == comm.SHIM_BACKEND
        shapes[name] = [list(s) for s in shim.layout.subgroups]
        run_layout(name, shim, dist.group.WORLD, ck)
    # a group over part of the world: global ranks 1, 2, 3 (vendors a, a, b under "3+1")
    comm.set_vendor_map(LAYOUTS["3+1"])
    sub_ranks = [1, 2, 3]
    shim = dist.new_group(sub_ranks, backend=comm.SHIM_BACKEND)
    flat = dist.new_group(sub_ranks, backend="gloo")
    if dist.get_rank() in sub_ranks:
        shapes["subset 1,2,3"] = [list(s) for s in shim.layout.subgroups]
        run_layout("subset", shim, flat, ck)
    # vendors from the environment: each rank tags itself (gathered through the store), then a job-wide map
    comm.set_vendor_map(None)
    for label, env in (("HET_PLUGIN_VENDOR", {comm.ENV_VENDOR: ["amd", "nvidia", "amd", "nvidia"][dist.get_rank()]}),
                       ("HET_PLUGIN_VENDOR_MAP", {comm.ENV_VENDOR_MAP: "nvidia*3,amd"})):
        os.environ.update(env)
        shim = dist.new_group(list(range(world)), backend=comm.SHIM_BACKEND)
        for k in env:
            del os.environ[k]
        shapes[label] = [list(s) for s in shim.layout.subgroups]
        x = sample(torch.int64, (3001,), 7 * dist.get_rank())
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, group=shim)
        dist.all_reduce(b)
        ck.same(f"{label} all_reduce", a, b)
    dist.barrier()
    report({"checks": ck.checks, "failures": ck.failures[:40], "nfail": len(ck.failures), "layouts": shapes})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
